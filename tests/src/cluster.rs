//! A real multi-node Ferry cluster for one test: an etcd and N `ferryd` storage
//! nodes, each node in a network namespace of its own.
//!
//! ```text
//! root namespace: etcd  127.0.0.1:P, 10.A.1.1:P ... 10.A.N.1:P   (peer 127.0.0.1:Q)
//!                 rcp, ferry (the test's clients)
//!   veth 10.A.K.1 <-> 10.A.K.2 : namespace ferrytest-PID-C-nK
//!                                ferryd --cluster http://10.A.K.1:P --node-id nK
//!                                       --store <tmp>/nodeK --listen 10.A.K.2:7447 ...
//! <tmp>/etcd/  <tmp>/etcd.stderr  <tmp>/nodeK/  <tmp>/nodeK.stderr  <tmp>/nodeK.port
//! ```
//!
//! Nodes are numbered `1..=N` (node `K` is `nK` on `10.A.K.2`). The network plumbing is
//! in `netns.rs`, etcd in `etcd.rs`. Every node's ferryd gets the same environment as
//! a [`crate::Server`]'s (transport, [`crate::TEST_SECRET`], encryption `preferred`);
//! its arguments come from one function, [`ferryd_args`]. [`NodeMode::Plain`] runs
//! today's ferryd instead (`--share data=<tmp>/nodeK`), to test the plumbing alone.
//!
//! With [`ClusterOptions::tls`], etcd serves TLS only and requires client certificates
//! (`certs.rs` makes them in `<tmp>/tls/`); `<tmp>/tls/cluster.toml` is a cluster
//! configuration file naming the CA and the client certificate, which every node's
//! ferryd is given (`--cluster-config`) and every client the harness runs gets in
//! `$FERRY_CLUSTER_CONFIG` ([`Cluster::client_env`]). With
//! [`ClusterOptions::node_etcd_user`], nodes also log in to etcd as that user, its
//! password in `<tmp>/etcd-users/USER.password` (`ferry cluster auth-setup
//! --password-dir` writes it there).
//!
//! Dropping the [`Cluster`] (also on panic) SIGKILLs every ferryd and etcd, deletes the
//! namespaces (their veth pairs go with them) and the temp dir, and releases the
//! subnet; if the thread is panicking it first prints every node's and etcd's log.
//!
//! Needs root (`ip netns`, veth, `tc`) and etcd: [`skip_without_cluster`].

use std::ffi::{OsStr, OsString};
use std::fs::{self, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::thread;
use std::time::{Duration, Instant};

use nix::sys::signal::Signal;
use tempfile::TempDir;

use crate::certs::{make_certs, Certs};
use crate::etcd::{etcd_program, Etcd};
use crate::netns::{reap_stale, NetNs, Subnet, NS_PREFIX};
use crate::rcp::{spawn_program, ProgramOutput};
use crate::server::{bin, read_log, set_ferryd_env, wait_for_port_file, Share};

/// The port every node's ferryd listens on, inside its namespace.
pub const NODE_PORT: u16 = 7447;

/// The most nodes a [`Cluster`] runs.
pub const MAX_NODES: usize = 8;

/// The share a [`NodeMode::Plain`] node serves its store as.
pub const PLAIN_SHARE: &str = "data";

/// The `--lease-ttl` of every node unless [`ClusterOptions::lease_ttl`] says otherwise:
/// how long etcd keeps a node that stopped renewing.
pub const LEASE_TTL: Duration = Duration::from_secs(3);

/// How long one `ferry` run may take before it is killed and the test fails.
pub const FERRY_TIMEOUT: Duration = Duration::from_secs(60);

/// How often [`Cluster::wait_nodes`] asks `ferry cluster status`.
const STATUS_POLL: Duration = Duration::from_millis(200);

/// Clusters started by this process so far: part of every name, with the pid.
static NEXT_CLUSTER: AtomicU32 = AtomicU32::new(0);

/// How a [`Cluster`]'s ferryd nodes run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum NodeMode {
    /// Cluster mode: `--cluster http://10.A.K.1:P --node-id nK --store DIR ...`.
    #[default]
    Cluster,
    /// A plain ferryd serving its store as share [`PLAIN_SHARE`] (no etcd flags).
    Plain,
}

/// What one node's ferryd is started with; [`ferryd_args`] turns it into arguments.
#[derive(Debug, Clone)]
pub struct NodeSpec {
    /// How the node runs.
    pub mode: NodeMode,
    /// etcd as the node reaches it: `http://10.A.K.1:P`.
    pub etcd_url: String,
    /// `nK`.
    pub node_id: String,
    /// The node's store directory.
    pub store: PathBuf,
    /// `10.A.K.2:7447`.
    pub listen: String,
    /// Where ferryd writes its address once it listens.
    pub port_file: PathBuf,
    /// More arguments in cluster mode: etcd's TLS and user settings.
    pub etcd_args: Vec<OsString>,
    /// Its `--lease-ttl` (cluster mode).
    pub lease_ttl: Duration,
}

/// The arguments of a node's ferryd (the program and its environment are the
/// harness's): in cluster mode `--cluster URL --node-id ID --store DIR --listen ADDR
/// --port-file FILE --lease-ttl 3`, in plain mode `--share data=DIR --listen ADDR
/// --port-file FILE`.
pub fn ferryd_args(spec: &NodeSpec) -> Vec<OsString> {
    let mut args: Vec<OsString> = Vec::new();
    match spec.mode {
        NodeMode::Cluster => {
            args.extend(["--cluster".into(), spec.etcd_url.clone().into()]);
            args.extend(["--node-id".into(), spec.node_id.clone().into()]);
            args.extend(["--store".into(), spec.store.clone().into_os_string()]);
        }
        NodeMode::Plain => {
            args.extend(["--share".into(), Share::rw(PLAIN_SHARE, &spec.store).arg()]);
        }
    }
    args.extend(["--listen".into(), spec.listen.clone().into()]);
    args.extend([
        "--port-file".into(),
        spec.port_file.clone().into_os_string(),
    ]);
    if spec.mode == NodeMode::Cluster {
        let ttl = spec.lease_ttl.as_secs().max(1);
        args.extend(["--lease-ttl".into(), ttl.to_string().into()]);
        args.extend(spec.etcd_args.iter().cloned());
    }
    args
}

/// Prints why `test` is skipped and returns true where a [`Cluster`] cannot run: not
/// root (namespaces, veth and `tc` need it), no `ip` or `tc`, no etcd, or the RDMA
/// suite (a node's veth has no RDMA device).
pub fn skip_without_cluster(test: &str) -> bool {
    let why = if crate::test_transport() == "rdma" {
        Some("the RDMA suite: the nodes' veth pairs have no RDMA device".to_owned())
    } else if !nix::unistd::geteuid().is_root() {
        Some("needs root (ip netns, veth, tc)".to_owned())
    } else if let Some(tool) = ["ip", "tc"]
        .into_iter()
        .find(|t| crate::program_on_path(t).is_none())
    {
        Some(format!("`{tool}` is not installed (iproute2)"))
    } else if !etcd_program().is_file() {
        Some(format!(
            "no etcd at {} (etcd-server; or set FERRY_ETCD)",
            etcd_program().display()
        ))
    } else {
        None
    };
    if let Some(why) = &why {
        // CI installs everything (scripts/setup.sh) and runs as root: a missing piece
        // there is a failure, not a reason to pass. The RDMA suite is the exception.
        if std::env::var_os("CI").is_some() && crate::test_transport() != "rdma" {
            panic!("{test}: cannot run under CI: {why}");
        }
        eprintln!("{test}: skipped: {why}");
    }
    why.is_some()
}

/// Whether the ferryd in [`crate::bin_dir`] has cluster mode (`--cluster` in its
/// `--help`).
pub fn ferryd_has_cluster_mode() -> bool {
    Command::new(bin("ferryd"))
        .arg("--help")
        .output()
        .is_ok_and(|out| String::from_utf8_lossy(&out.stdout).contains("--cluster"))
}

/// Runs `ferry ARGS...` (the cluster admin tool in [`crate::bin_dir`]) to completion,
/// at most [`FERRY_TIMEOUT`], with the environment rcp gets (the test transport and
/// [`crate::TEST_SECRET`]).
#[track_caller]
pub fn ferry<I, S>(args: I) -> ProgramOutput
where
    I: IntoIterator<Item = S>,
    S: AsRef<OsStr>,
{
    spawn_program("ferry", &bin("ferry"), None, &[], args).wait_at_most(FERRY_TIMEOUT)
}

/// One storage node: its namespace and, while it runs, its ferryd.
#[derive(Debug)]
struct Node {
    spec: NodeSpec,
    log_path: PathBuf,
    child: Option<Child>,
    /// Dropped after the process is gone (Cluster's drop kills it first).
    ns: NetNs,
}

impl Node {
    fn start(&mut self) -> Result<(), String> {
        assert!(
            self.child.is_none(),
            "{} is already running",
            self.spec.node_id
        );
        // Ignoring errors: the file is absent unless the node ran before.
        let _ = fs::remove_file(&self.spec.port_file);
        let mut log = OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log_path)
            .map_err(|e| format!("cannot open {}: {e}", self.log_path.display()))?;
        // A marker between the runs of one log; a failed write only loses the marker.
        let _ = writeln!(log, "----- ferryd {} starts -----", self.spec.node_id);
        let mut cmd = self.ns.command(bin("ferryd"));
        cmd.args(ferryd_args(&self.spec));
        set_ferryd_env(&mut cmd);
        cmd.stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::from(log));
        let mut child = cmd
            .spawn()
            .map_err(|e| format!("cannot start {cmd:?}: {e}"))?;
        match wait_for_port_file(&self.spec.port_file, &mut child, &self.log_path) {
            Ok(_) => {
                self.child = Some(child);
                Ok(())
            }
            Err(e) => {
                let _ = child.kill();
                let _ = child.wait();
                Err(format!("node {}: {e}", self.spec.node_id))
            }
        }
    }

    fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            // A stopped process dies of SIGKILL too; SIGCONT first all the same, so
            // nothing of the test is ever left stopped. Ignoring errors: it may have
            // exited already.
            let _ = self.signal(&child, Signal::SIGCONT);
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Sends `signal` to the running ferryd `child`.
    fn signal(&self, child: &Child, signal: Signal) -> Result<(), String> {
        let pid = i32::try_from(child.id()).map_err(|e| e.to_string())?;
        nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), signal)
            .map_err(|e| format!("node {}: {signal}: {e}", self.spec.node_id))
    }

    /// Sends `signal` to the node's ferryd; panics if it is not running.
    #[track_caller]
    fn send(&self, signal: Signal) {
        let child = self
            .child
            .as_ref()
            .unwrap_or_else(|| panic!("{} is not running", self.spec.node_id));
        self.signal(child, signal).unwrap_or_else(|e| panic!("{e}"));
    }
}

/// A node stopped by [`Cluster::stop_node`]: continued when dropped, so no test leaves
/// a ferryd stopped (a failing one included).
#[derive(Debug)]
#[must_use = "the node is continued when this guard drops"]
pub struct StoppedNode {
    pid: nix::unistd::Pid,
}

impl StoppedNode {
    /// Continues the node now.
    pub fn cont(self) {}
}

impl Drop for StoppedNode {
    fn drop(&mut self) {
        // Ignoring errors: the node may have been killed since.
        let _ = nix::sys::signal::kill(self.pid, Signal::SIGCONT);
    }
}

/// The state letter of process `pid` in `/proc/PID/stat` (`T`: stopped by a signal).
fn process_state(pid: u32) -> Option<char> {
    let stat = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // `PID (COMM) S ...`: COMM may hold spaces and parentheses; the state follows the
    // last `)`.
    stat.rsplit_once(')')?.1.trim_start().chars().next()
}

/// What [`Cluster::start_with`] starts.
#[derive(Debug, Clone)]
pub struct ClusterOptions {
    /// How many storage nodes, `1..=`[`MAX_NODES`].
    pub nodes: usize,
    /// How their ferryd runs.
    pub mode: NodeMode,
    /// etcd serves TLS only and requires client certificates (see the module docs).
    pub tls: bool,
    /// The etcd user the nodes log in as, if any (see the module docs).
    pub node_etcd_user: Option<String>,
    /// Every node's `--lease-ttl` (whole seconds; [`LEASE_TTL`] normally).
    pub lease_ttl: Duration,
}

impl Default for ClusterOptions {
    /// One cluster-mode node, plain etcd, leases of [`LEASE_TTL`].
    fn default() -> ClusterOptions {
        ClusterOptions {
            nodes: 1,
            mode: NodeMode::Cluster,
            tls: false,
            node_etcd_user: None,
            lease_ttl: LEASE_TTL,
        }
    }
}

/// An etcd and N ferryd nodes, each node in its own network namespace; see the
/// module docs. Nodes are numbered `1..=N`; methods taking a node `k` panic outside
/// that range.
#[derive(Debug)]
pub struct Cluster {
    /// Declared (and so dropped) before `_subnet`: the namespaces go before the claim.
    nodes: Vec<Node>,
    etcd: Etcd,
    /// With TLS: the certificates, and the cluster configuration file naming them.
    tls: Option<(Certs, PathBuf)>,
    /// The etcd user the harness's clients log in as, and its password file.
    client_user: Option<(String, String)>,
    _subnet: Subnet,
    dir: TempDir,
}

impl Cluster {
    /// Starts `nodes` nodes in cluster mode ([`NodeMode::Cluster`]) and their etcd.
    /// Returns once etcd is healthy and every ferryd wrote its port file; it does not
    /// wait for the nodes to register ([`Cluster::wait_nodes`]).
    pub fn start(nodes: usize) -> Cluster {
        Cluster::start_with(ClusterOptions {
            nodes,
            mode: NodeMode::Cluster,
            ..ClusterOptions::default()
        })
    }

    /// Starts `nodes` nodes in cluster mode, waits (at most 20 s) until they are all
    /// registered, and creates cluster share `share` with `replicas` replicas and
    /// stripes of `stripe_mib` MiB (`ferry cluster add-share`).
    #[track_caller]
    pub fn start_with_share(nodes: usize, share: &str, replicas: u8, stripe_mib: u64) -> Cluster {
        Cluster::start_with_share_ttl(nodes, share, replicas, stripe_mib, LEASE_TTL)
    }

    /// [`Cluster::start_with_share`] with every node's lease `lease_ttl` (a node stopped
    /// by [`Cluster::stop_node`] stays registered that long).
    #[track_caller]
    pub fn start_with_share_ttl(
        nodes: usize,
        share: &str,
        replicas: u8,
        stripe_mib: u64,
        lease_ttl: Duration,
    ) -> Cluster {
        let cluster = Cluster::start_with(ClusterOptions {
            nodes,
            mode: NodeMode::Cluster,
            lease_ttl,
            ..ClusterOptions::default()
        });
        cluster.wait_nodes(nodes, Duration::from_secs(20));
        cluster.add_share(share, replicas, stripe_mib);
        cluster
    }

    /// Creates cluster share `share` with `replicas` replicas and stripes of
    /// `stripe_mib` MiB (`ferry cluster add-share`, with [`Cluster::client_env`]).
    #[track_caller]
    pub fn add_share(&self, share: &str, replicas: u8, stripe_mib: u64) {
        self.ferry([
            "cluster",
            "add-share",
            "--etcd",
            &self.etcd_endpoint(),
            share,
            "--replicas",
            &replicas.to_string(),
            "--stripe-mib",
            &stripe_mib.to_string(),
        ])
        .assert_success();
    }

    /// Starts `nodes` plain ferryd nodes ([`NodeMode::Plain`]) and an etcd they do not
    /// use: the harness's plumbing with today's ferryd.
    pub fn start_plain(nodes: usize) -> Cluster {
        Cluster::start_with(ClusterOptions {
            nodes,
            mode: NodeMode::Plain,
            ..ClusterOptions::default()
        })
    }

    /// Starts what `opts` says; panics (after cleaning up) if anything fails to start.
    #[track_caller]
    pub fn start_with(opts: ClusterOptions) -> Cluster {
        assert!(
            (1..=MAX_NODES).contains(&opts.nodes),
            "a cluster has 1..={MAX_NODES} nodes, not {}",
            opts.nodes
        );
        reap_stale();
        let pid = std::process::id();
        let serial = NEXT_CLUSTER.fetch_add(1, Ordering::Relaxed);
        let subnet = Subnet::claim(pid.wrapping_add(serial)).unwrap_or_else(|e| panic!("{e}"));
        let dir = tempfile::Builder::new()
            .prefix("ferry-cluster-")
            .tempdir()
            .expect("cannot create the cluster's temp dir");
        let mut namespaces = Vec::with_capacity(opts.nodes);
        for k in 1..=opts.nodes {
            let k8 = u8::try_from(k).expect("at most MAX_NODES nodes");
            // Interface names: at most 15 bytes (`f` + 6 hex digits of the pid + `x` +
            // the serial in hex + `h`/`n` + K).
            let ns = NetNs::create(
                format!("{NS_PREFIX}{pid}-{serial}-n{k}"),
                format!("f{pid:x}x{serial:x}h{k}"),
                format!("f{pid:x}x{serial:x}n{k}"),
                subnet.a(),
                k8,
            )
            .unwrap_or_else(|e| panic!("node {k}'s network namespace: {e}"));
            namespaces.push(ns);
        }
        let hosts: Vec<_> = namespaces.iter().map(NetNs::host_ip).collect();
        let name = format!("ferrytest-{pid}-{serial}");
        let tls = opts.tls.then(|| tls_files(dir.path(), &hosts));
        let etcd = match &tls {
            Some((certs, _)) => Etcd::start_tls(dir.path(), name, hosts, certs.clone()),
            None => Etcd::start(dir.path(), name, hosts),
        }
        .unwrap_or_else(|e| panic!("{e}"));
        let port = etcd.client_port();
        let scheme = etcd.scheme();
        let etcd_args = node_etcd_args(dir.path(), &tls, &opts.node_etcd_user);
        let nodes = namespaces
            .into_iter()
            .enumerate()
            .map(|(i, ns)| {
                let k = i + 1;
                let store = dir.path().join(format!("node{k}"));
                fs::create_dir(&store).expect("cannot create a node's store");
                Node {
                    spec: NodeSpec {
                        mode: opts.mode,
                        etcd_url: format!("{scheme}://{}:{port}", ns.host_ip()),
                        node_id: format!("n{k}"),
                        store,
                        listen: format!("{}:{NODE_PORT}", ns.ns_ip()),
                        port_file: dir.path().join(format!("node{k}.port")),
                        etcd_args: etcd_args.clone(),
                        lease_ttl: opts.lease_ttl,
                    },
                    log_path: dir.path().join(format!("node{k}.stderr")),
                    child: None,
                    ns,
                }
            })
            .collect();
        let mut cluster = Cluster {
            nodes,
            etcd,
            tls,
            client_user: None,
            _subnet: subnet,
            dir,
        };
        for k in 1..=opts.nodes {
            cluster.start_node(k);
        }
        cluster
    }

    fn node(&self, k: usize) -> &Node {
        assert!(
            (1..=self.nodes.len()).contains(&k),
            "no node {k}: this cluster has nodes 1..={}",
            self.nodes.len()
        );
        &self.nodes[k - 1]
    }

    fn node_mut(&mut self, k: usize) -> &mut Node {
        self.node(k);
        &mut self.nodes[k - 1]
    }

    /// How many nodes the cluster has (running or not).
    pub fn node_count(&self) -> usize {
        self.nodes.len()
    }

    /// etcd's client endpoint from the root namespace, `127.0.0.1:PORT` (what
    /// `ferry cluster ... --etcd` takes).
    pub fn etcd_endpoint(&self) -> String {
        format!("127.0.0.1:{}", self.etcd.client_port())
    }

    /// etcd's URL as node `k` reaches it, `http://10.A.K.1:PORT` (`https://` with
    /// TLS).
    pub fn etcd_url_for(&self, k: usize) -> String {
        self.node(k).spec.etcd_url.clone()
    }

    /// Whether etcd answers `GET /health` healthy on `127.0.0.1`.
    pub fn etcd_healthy(&self) -> bool {
        self.etcd.healthy()
    }

    /// With TLS: the certificates etcd and the clients use.
    pub fn certs(&self) -> Option<&Certs> {
        self.tls.as_ref().map(|(c, _)| c)
    }

    /// With TLS: the cluster configuration file naming the CA and the client
    /// certificate (`[tls]`).
    pub fn cluster_config(&self) -> Option<&Path> {
        self.tls.as_ref().map(|(_, f)| f.as_path())
    }

    /// Where etcd users' password files are (`ferry cluster auth-setup
    /// --password-dir`): `<tmp>/etcd-users`, made at start.
    pub fn etcd_users_dir(&self) -> PathBuf {
        etcd_users_dir(self.dir.path())
    }

    /// Makes the harness's clients log in to etcd as `user` (password in
    /// [`Cluster::etcd_users_dir`]`/USER.password`), or as nobody.
    pub fn set_client_etcd_user(&mut self, user: Option<&str>) {
        self.client_user = user.map(|u| {
            let file = self.etcd_users_dir().join(format!("{u}.password"));
            let file = file.to_str().expect("the temp dir's path is UTF-8");
            (u.to_owned(), file.to_owned())
        });
    }

    /// The environment of the harness's clients: `$FERRY_CLUSTER_CONFIG` set to
    /// [`Cluster::cluster_config`] with TLS, `$FERRY_ETCD_USER` and
    /// `$FERRY_ETCD_PASSWORD_FILE` to [`Cluster::set_client_etcd_user`]'s; each
    /// removed otherwise. For [`crate::rcp_env`].
    pub fn client_env(&self) -> Vec<(&'static str, Option<&str>)> {
        let config = self.cluster_config().map(|p| {
            p.to_str()
                .expect("the temp dir's path is UTF-8 (tempfile names it)")
        });
        let user = self.client_user.as_ref();
        vec![
            ("FERRY_CLUSTER_CONFIG", config),
            ("FERRY_ETCD_USER", user.map(|u| u.0.as_str())),
            ("FERRY_ETCD_PASSWORD_FILE", user.map(|u| u.1.as_str())),
        ]
    }

    /// Runs `ferry ARGS...` as [`ferry`] does, with [`Cluster::client_env`].
    #[track_caller]
    pub fn ferry<I, S>(&self, args: I) -> ProgramOutput
    where
        I: IntoIterator<Item = S>,
        S: AsRef<OsStr>,
    {
        spawn_program("ferry", &bin("ferry"), None, &self.client_env(), args)
            .wait_at_most(FERRY_TIMEOUT)
    }

    /// The rcp URL of `path` in cluster share `share`:
    /// `cluster://127.0.0.1:PORT/SHARE/PATH`.
    pub fn url(&self, share: &str, path: &str) -> String {
        format!("cluster://{}/{share}/{path}", self.etcd_endpoint())
    }

    /// Runs `f` with a connection to the cluster's etcd, on a runtime of its own.
    pub fn with_meta<T, F, Fut>(&self, f: F) -> T
    where
        F: FnOnce(ferry_cluster::Meta) -> Fut,
        Fut: std::future::Future<Output = T>,
    {
        let endpoint = self.etcd_endpoint();
        crate::runtime().block_on(async {
            let config = ferry_cluster::EtcdConfig::plain(vec![endpoint]);
            let meta = ferry_cluster::Meta::connect(&config).await.expect("etcd");
            f(meta).await
        })
    }

    /// The layout of file `path` of cluster share `share`, read from etcd; panics if
    /// there is no such file.
    pub fn layout_of(&self, share: &str, path: &str) -> ferry_cluster::model::Layout {
        self.with_meta(|meta| async move {
            let v = meta.existing(share, path).await.expect("the entry");
            v.entry.layout.expect("a file's layout")
        })
    }

    /// (node id, object path in the store share) of every stripe object on the nodes,
    /// with its size: only names that are objects' (not the nodes' partial uploads).
    pub fn objects(&self) -> std::collections::BTreeMap<(String, String), u64> {
        let mut out = std::collections::BTreeMap::new();
        for k in 1..=self.node_count() {
            let store = self.node_store(k);
            let mut dirs = vec![store.clone()];
            while let Some(dir) = dirs.pop() {
                for e in std::fs::read_dir(&dir).into_iter().flatten().flatten() {
                    let (p, md) = (e.path(), e.metadata().expect("stat in a store"));
                    let rel = p.strip_prefix(&store).expect("below the store");
                    let rel = rel.to_str().expect("UTF-8 store path").to_owned();
                    if md.is_dir() {
                        dirs.push(p);
                    } else if ferry_cluster::model::ObjectPath::parse(&rel).is_some() {
                        out.insert((self.node_id(k), rel), md.len());
                    }
                }
            }
        }
        out
    }

    /// The traffic counters of every node, summed: the bytes the nodes pushed into
    /// clients' memory (`write_bytes`: downloads, a mount's stripe fetches) and pulled
    /// from it (`read_bytes`: uploads), one-sided, since they started. A mount's reads
    /// are its own one-sided READs of a node's memory and count in neither.
    pub fn traffic(&self) -> ferry_common::msg::Counters {
        let mut sum = ferry_common::msg::Counters::default();
        for k in 1..=self.node_count() {
            let c = self.node_counters(k);
            sum.write_bytes += c.write_bytes;
            sum.read_bytes += c.read_bytes;
            sum.ctrl_received_bytes += c.ctrl_received_bytes;
            sum.ctrl_sent_bytes += c.ctrl_sent_bytes;
            sum.file_written_bytes += c.file_written_bytes;
        }
        sum
    }

    /// Node `k`'s traffic counters (see [`Cluster::traffic`]), asked over a session of
    /// its store share.
    pub fn node_counters(&self, k: usize) -> ferry_common::msg::Counters {
        let addr = self.node_addr(k);
        let (host, port) = addr.rsplit_once(':').expect("HOST:PORT");
        let port: u16 = port.parse().expect("a port");
        crate::runtime().block_on(async {
            let choice = ferry_common::transport::TransportChoice::Tcp;
            let c = crate::secret::connect_to(host, port, choice)
                .await
                .unwrap_or_else(|e| panic!("node {k} at {addr}: {e}"));
            c.authenticate(ferry_cluster::model::STORE_SHARE)
                .await
                .unwrap_or_else(|e| panic!("node {k}: the store share's secret: {e}"));
            c.counters()
                .await
                .unwrap_or_else(|e| panic!("node {k}: counters: {e}"))
        })
    }

    /// Node `k`'s ferryd address, `10.A.K.2:7447`.
    pub fn node_addr(&self, k: usize) -> String {
        self.node(k).spec.listen.clone()
    }

    /// Node `k`'s id, `nK`.
    pub fn node_id(&self, k: usize) -> String {
        self.node(k).spec.node_id.clone()
    }

    /// Node `k`'s store directory (a plain node's share [`PLAIN_SHARE`]).
    pub fn node_store(&self, k: usize) -> PathBuf {
        self.node(k).spec.store.clone()
    }

    /// Node `k`'s ferryd log so far, across restarts.
    pub fn node_log(&self, k: usize) -> String {
        read_log(&self.node(k).log_path)
    }

    /// Whether node `k`'s ferryd runs (it was started and has not exited).
    pub fn node_running(&mut self, k: usize) -> bool {
        let node = self.node_mut(k);
        node.child
            .as_mut()
            .is_some_and(|c| matches!(c.try_wait(), Ok(None)))
    }

    /// etcd's log so far, across restarts.
    pub fn etcd_log(&self) -> String {
        self.etcd.log()
    }

    /// SIGKILLs node `k`'s ferryd and reaps it (no chance to deregister: its lease
    /// runs out after [`LEASE_TTL`]).
    pub fn kill_node(&mut self, k: usize) {
        self.node_mut(k).kill();
    }

    /// SIGSTOPs node `k`'s ferryd: alive, its connections and listening socket open,
    /// answering nothing (a hung node). Its lease runs out after its TTL unless
    /// it is continued. It is continued (SIGCONT) when the returned guard drops, or
    /// [`Cluster::cont_node`]; dropping the cluster continues and kills it.
    #[track_caller]
    pub fn stop_node(&mut self, k: usize) -> StoppedNode {
        let node = self.node(k);
        node.send(Signal::SIGSTOP);
        let pid = node
            .child
            .as_ref()
            .map(Child::id)
            .expect("running: just signalled");
        StoppedNode {
            pid: nix::unistd::Pid::from_raw(i32::try_from(pid).expect("a pid")),
        }
    }

    /// SIGCONTs node `k`'s ferryd, stopped by [`Cluster::stop_node`].
    #[track_caller]
    pub fn cont_node(&mut self, k: usize) {
        self.node(k).send(Signal::SIGCONT);
    }

    /// Whether node `k`'s ferryd is stopped by a signal now (`/proc/PID/stat`).
    pub fn node_stopped(&self, k: usize) -> bool {
        self.node(k)
            .child
            .as_ref()
            .and_then(|c| process_state(c.id()))
            == Some('T')
    }

    /// Starts node `k`'s ferryd again with the same store, address and arguments and
    /// waits for its port file; panics if it is running or does not come up.
    #[track_caller]
    pub fn start_node(&mut self, k: usize) {
        self.node_mut(k).start().unwrap_or_else(|e| panic!("{e}"));
    }

    /// SIGKILLs etcd and reaps it.
    pub fn stop_etcd(&mut self) {
        self.etcd.kill();
    }

    /// Starts etcd again with the same data dir and ports; waits until it is healthy.
    #[track_caller]
    pub fn start_etcd(&mut self) {
        self.etcd.restart().unwrap_or_else(|e| panic!("{e}"));
    }

    /// Restores etcd from `snapshot` (`ferry cluster etcd-snapshot`'s file) into a fresh
    /// data dir with `etcdctl snapshot restore`, on the same ports; waits until it is
    /// healthy.
    #[track_caller]
    pub fn restore_etcd(&mut self, snapshot: &Path) {
        self.etcd
            .restore(snapshot)
            .unwrap_or_else(|e| panic!("{e}"));
    }

    /// Shapes node `k`'s link to `bytes_per_sec` each way (`tc` tbf at both ends of
    /// its veth; see `netns.rs` for the bucket and queue sizes).
    #[track_caller]
    pub fn limit_rate(&self, k: usize, bytes_per_sec: u64) {
        self.node(k)
            .ns
            .limit_rate(bytes_per_sec)
            .unwrap_or_else(|e| panic!("node {k}: {e}"));
    }

    /// A command running `program` in node `k`'s namespace (`ip netns exec NS
    /// PROGRAM`), for [`crate::run_tool`].
    pub fn command_in(&self, k: usize, program: impl AsRef<OsStr>) -> Command {
        self.node(k).ns.command(program)
    }

    /// The cluster's temp dir (etcd's data, the stores, the logs); a test may put its
    /// local files here too.
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// `ferry cluster status --etcd ENDPOINT --json`, parsed; panics unless it exits 0
    /// (every stripe has its replicas) or 8 (some do not), with one JSON object on
    /// stdout, and unless the exit code agrees with the counts.
    #[track_caller]
    pub fn status(&self) -> serde_json::Value {
        let out = self.ferry([
            "cluster",
            "status",
            "--etcd",
            &self.etcd_endpoint(),
            "--json",
        ]);
        let v = out.json();
        let unhealthy =
            v["under_replicated"].as_u64() != Some(0) || v["unavailable"].as_u64() != Some(0);
        let want = if unhealthy { Some(8) } else { Some(0) };
        assert_eq!(out.code, want, "ferry cluster status:\n{out}");
        v
    }

    /// Polls `ferry cluster status --etcd ENDPOINT --json` until exactly `n` of its
    /// `nodes` have `"live": true`, at most `timeout`; a failing status (etcd not
    /// ready yet) counts as not yet. Panics on timeout with the last status and every
    /// node's log.
    #[track_caller]
    pub fn wait_nodes(&self, n: usize, timeout: Duration) {
        let deadline = Instant::now() + timeout;
        let endpoint = self.etcd_endpoint();
        let args = ["cluster", "status", "--etcd", endpoint.as_str(), "--json"];
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let out = spawn_program("ferry", &bin("ferry"), None, &self.client_env(), args)
                .wait_at_most(left.max(Duration::from_secs(1)));
            // 8: some stripes lack replicas (a node is down), which is what a test
            // waiting for fewer nodes expects.
            let live = matches!(out.code, Some(0) | Some(8))
                .then(|| live_nodes(&out.stdout))
                .flatten();
            if live == Some(n) {
                return;
            }
            if Instant::now() >= deadline {
                panic!(
                    "{n} live nodes expected within {timeout:?}, the last status had {live:?}\n{out}\n{}",
                    self.logs()
                );
            }
            thread::sleep(STATUS_POLL);
        }
    }

    /// Every node's log and etcd's, for failure messages.
    pub fn logs(&self) -> String {
        let mut text = String::new();
        for (i, node) in self.nodes.iter().enumerate() {
            text += &format!(
                "----- node {} ({}, {}) stderr -----\n{}",
                i + 1,
                node.spec.node_id,
                node.spec.listen,
                read_log(&node.log_path)
            );
        }
        text += &format!(
            "----- etcd ({}) log -----\n{}----- end of the cluster's logs -----",
            self.etcd_endpoint(),
            self.etcd.log()
        );
        text
    }
}

/// `<tmp>/etcd-users`.
fn etcd_users_dir(tmp: &Path) -> PathBuf {
    tmp.join("etcd-users")
}

/// Makes `<tmp>/tls/` (certificates for etcd on `127.0.0.1` and `hosts`) and the
/// cluster configuration file `<tmp>/tls/cluster.toml` naming the CA and the client
/// certificate by paths relative to it.
fn tls_files(tmp: &Path, hosts: &[std::net::Ipv4Addr]) -> (Certs, PathBuf) {
    let dir = tmp.join("tls");
    fs::create_dir(&dir).expect("cannot create the certificates' directory");
    let certs = make_certs(&dir, hosts);
    let config = dir.join("cluster.toml");
    fs::write(
        &config,
        "# etcd over TLS with a client certificate (the test harness's)\n\
         [tls]\nca = \"ca.pem\"\ncert = \"client.pem\"\nkey = \"client.key\"\n",
    )
    .expect("cannot write the cluster configuration file");
    (certs, config)
}

/// A node's etcd arguments: the cluster configuration file with TLS, and its user.
fn node_etcd_args(
    tmp: &Path,
    tls: &Option<(Certs, PathBuf)>,
    user: &Option<String>,
) -> Vec<OsString> {
    let mut args: Vec<OsString> = Vec::new();
    fs::create_dir_all(etcd_users_dir(tmp)).expect("cannot create the etcd users' directory");
    if let Some((_, config)) = tls {
        args.extend(["--cluster-config".into(), config.clone().into_os_string()]);
    }
    if let Some(user) = user {
        let password = etcd_users_dir(tmp).join(format!("{user}.password"));
        args.extend(["--etcd-user".into(), user.into()]);
        args.extend(["--etcd-password-file".into(), password.into_os_string()]);
    }
    args
}

/// The number of `nodes` with `"live": true` in `ferry cluster status --json`'s
/// stdout; `None` if it is not such an object.
fn live_nodes(stdout: &str) -> Option<usize> {
    let value: serde_json::Value = serde_json::from_str(stdout.trim()).ok()?;
    let nodes = value.get("nodes")?.as_array()?;
    Some(
        nodes
            .iter()
            .filter(|n| n.get("live") == Some(&serde_json::Value::Bool(true)))
            .count(),
    )
}

impl Drop for Cluster {
    fn drop(&mut self) {
        for node in &mut self.nodes {
            node.kill();
        }
        self.etcd.kill();
        if thread::panicking() {
            eprintln!("{}", self.logs());
        }
        // Then the fields: the namespaces, etcd (already stopped), the subnet's claim,
        // the temp dir.
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The arguments of node 2 in `mode`, joined by spaces.
    fn args_of(mode: NodeMode) -> String {
        let spec = NodeSpec {
            mode,
            etcd_url: "http://10.100.2.1:2379".into(),
            node_id: "n2".into(),
            store: "/tmp/c/node2".into(),
            listen: "10.100.2.2:7447".into(),
            port_file: "/tmp/c/node2.port".into(),
            etcd_args: vec!["--cluster-config".into(), "/tmp/c/tls/cluster.toml".into()],
            lease_ttl: LEASE_TTL,
        };
        let args: Vec<String> = ferryd_args(&spec)
            .into_iter()
            .map(|a| a.into_string().unwrap())
            .collect();
        args.join(" ")
    }

    #[test]
    fn the_state_of_a_process_is_read_past_its_name() {
        // This test's own thread is running, or between two steps of it sleeping.
        let state = process_state(std::process::id());
        assert!(matches!(state, Some('R' | 'S')), "{state:?}");
        assert_eq!(process_state(u32::MAX), None);
    }

    #[test]
    fn cluster_nodes_get_the_cluster_flags() {
        assert_eq!(
            args_of(NodeMode::Cluster),
            "--cluster http://10.100.2.1:2379 --node-id n2 --store /tmp/c/node2 \
             --listen 10.100.2.2:7447 --port-file /tmp/c/node2.port --lease-ttl 3 \
             --cluster-config /tmp/c/tls/cluster.toml"
        );
    }

    #[test]
    fn plain_nodes_share_their_store() {
        assert_eq!(
            args_of(NodeMode::Plain),
            "--share data=/tmp/c/node2 --listen 10.100.2.2:7447 --port-file /tmp/c/node2.port"
        );
    }

    #[test]
    fn live_nodes_are_counted() {
        let status = r#"{"nodes":[{"id":"n1","addr":"10.1.1.2:7447","live":true},
            {"id":"n2","addr":"10.1.2.2:7447","live":false},{"id":"n3","live":true}]}"#;
        assert_eq!(live_nodes(&status.replace('\n', "")), Some(2));
        assert_eq!(live_nodes("{}"), None);
        assert_eq!(live_nodes("not json"), None);
    }
}
