//! `ferry`: administration of a Ferry cluster (`ferry cluster
//! status|add-share|repair|gc|drain|rebalance|auth-setup`).

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Parser, Subcommand};
use ferry_client::{ClientError, Credentials};
use ferry_cluster::model::{ShareConfig, STRIPE_ALIGN};
use ferry_cluster::{
    auth_setup, balance, gc, repair, status, Cluster, EtcdArgs, EtcdConfig, EtcdError,
};
use ferry_common::seal::Encryption;
use ferry_common::transport::TransportChoice;

const AFTER_HELP: &str = "\
A Ferry cluster is an etcd cluster plus storage nodes, each a ferryd started with
  ferryd --cluster ETCD_HOST:2379 --node-id n1 --store /srv/ferry-store \\
         --listen 10.0.0.11:7447 --secret-file /etc/ferry/cluster.secret
Cluster shares hold their directories and file layouts in etcd and their file data
as stripes on the nodes (each stripe on --replicas distinct nodes). rcp reaches them
as cluster://ETCD_HOST[:PORT]/SHARE/PATH.

EXAMPLES:
  ferry cluster add-share data --etcd 10.0.0.1:2379 --replicas 2
  rcp -r photos cluster://10.0.0.1:2379/data/
  ferry cluster status --etcd 10.0.0.1:2379
  ferry cluster repair --etcd 10.0.0.1:2379     after a node was lost for good
  ferry cluster gc --etcd 10.0.0.1:2379 --dry-run
                                                what gc would remove (objects no
                                                layout names, older than 24h)
  ferry cluster drain n3 --etcd 10.0.0.1:2379   move every stripe off n3 before it
                                                is retired (run it again to resume)
  ferry cluster rebalance --etcd 10.0.0.1:2379 --dry-run
                                                after adding a node: the moves that
                                                would even out the stripes
  ferry cluster auth-setup --password-dir /etc/ferry/etcd-users
                                                turn on etcd's users and roles

ETCD SECURITY:
  Every program that talks to etcd (ferryd --cluster, rcp, ferry-mount, ferry) takes
  --etcd-ca, --etcd-cert, --etcd-key (TLS; etcd is then spoken to as https://) and
  --etcd-user, --etcd-password-file (etcd's user authentication), or reads them from
  the cluster configuration file: --cluster-config FILE, $FERRY_CLUSTER_CONFIG, else
  /etc/ferry/cluster.toml when it exists. Options win over the file. The file:
    endpoints = [\"10.0.0.1:2379\"]    # where no --etcd or cluster:// host is given
    [tls]
    ca = \"etcd-ca.pem\"               # paths relative to the file's directory
    cert = \"client.pem\"
    key = \"client.key\"
    [user]
    name = \"ferry-client\"
    password_file = \"ferry-client.password\"

EXIT CODES:
  0  success (status: every stripe has its replicas; repair: nothing left to do;
     gc: every live node listed and its garbage removed; drain: no layout names
     the node any more; rebalance: every planned move made)
  1  an error (etcd or a node unreachable, a stripe that could not be repaired, an
     object gc could not remove, a stripe drain or rebalance could not move)
  2  usage error
  3  cannot connect to etcd, or etcd refused the connection (TLS, user, password)
  8  status: some stripes are under-replicated or unavailable";

/// Administer a Ferry cluster: its nodes, shares and the replicas of its stripes.
#[derive(Parser, Debug)]
#[command(name = "ferry", version, after_help = AFTER_HELP)]
struct Args {
    #[command(subcommand)]
    command: Top,
}

#[derive(Subcommand, Debug)]
enum Top {
    /// Cluster administration.
    #[command(subcommand)]
    Cluster(Command),
}

#[derive(clap::Args, Debug)]
struct Common {
    /// The cluster's etcd: HOST:PORT (or URLs), comma-separated [default: the
    /// cluster configuration file's `endpoints`].
    #[arg(long, value_name = "ENDPOINTS", env = "FERRY_ETCD")]
    etcd: Option<String>,
    #[command(flatten)]
    etcd_args: EtcdArgs,
    /// Print one JSON object on stdout instead of text.
    #[arg(long)]
    json: bool,
}

/// How the commands that talk to the storage nodes reach them.
#[derive(clap::Args, Debug)]
struct NodeArgs {
    /// The cluster's secret (as for rcp).
    #[arg(long, value_name = "FILE", env = "FERRY_SECRET_FILE")]
    secret_file: Option<PathBuf>,
    #[arg(
        long,
        value_name = "auto|rdma|tcp",
        default_value = "auto",
        env = "FERRY_TRANSPORT"
    )]
    transport: TransportChoice,
    #[arg(
        long,
        value_name = "preferred|required|off",
        default_value = "preferred",
        env = "FERRY_ENCRYPTION"
    )]
    encryption: Encryption,
}

impl NodeArgs {
    /// Connects to the cluster, its nodes to be reached as these options say.
    async fn connect(&self, common: &Common) -> Result<Cluster, ClientError> {
        let creds = Credentials::from_file_or_env(self.secret_file.as_deref())?
            .with_encryption(self.encryption);
        Cluster::connect(&common.etcd()?, self.transport, creds).await
    }
}

/// `--grace`.
fn parse_grace(arg: &str) -> Result<Duration, String> {
    ferry_common::units::parse_duration(arg)
        .ok_or_else(|| format!("{arg:?}: not a duration (seconds, or with s, m, h or d: 24h)"))
}

impl Common {
    /// The etcd settings: --etcd (or the file's endpoints) with the TLS and user
    /// settings of the options and the cluster configuration file.
    fn etcd(&self) -> Result<EtcdConfig, ClientError> {
        let endpoints = self.etcd.as_ref().map(|e| vec![e.clone()]);
        Ok(self.etcd_args.resolve(endpoints)?)
    }
}

#[derive(Subcommand, Debug)]
enum Command {
    /// The nodes (live or down), space used and free, and the stripes' health.
    Status {
        #[command(flatten)]
        common: Common,
    },
    /// Create a cluster share, or change the settings new files get.
    AddShare {
        #[command(flatten)]
        common: Common,
        /// The share's name.
        name: String,
        /// Copies of each stripe, on distinct nodes.
        #[arg(long, default_value_t = ferry_cluster::model::DEFAULT_REPLICAS)]
        replicas: u8,
        /// Stripe size in MiB.
        #[arg(long, default_value_t = ferry_cluster::model::DEFAULT_STRIPE_BYTES >> 20)]
        stripe_mib: u64,
    },
    /// Give every under-replicated stripe new replicas on live nodes (after a node
    /// was lost), copied from a live replica and verified; then collect garbage as
    /// `gc` does, with the default grace period.
    Repair {
        #[command(flatten)]
        common: Common,
        #[command(flatten)]
        nodes: NodeArgs,
    },
    /// Remove the stripe objects that no layout names (no file, no snapshot, of any
    /// share) and that are older than the grace period, from every live node. Nodes
    /// that are down are reported and left for a later run.
    Gc {
        #[command(flatten)]
        common: Common,
        #[command(flatten)]
        nodes: NodeArgs,
        /// Keep unnamed objects changed within this long (`0`, `90m`, `24h`, `7d`):
        /// an upload in flight writes its objects before it commits their layout.
        /// Shorter than the longest upload could collect an upload still in flight.
        #[arg(long, value_name = "DURATION", default_value = "24h", value_parser = parse_grace)]
        grace: Duration,
        /// List what would be removed; remove nothing.
        #[arg(long)]
        dry_run: bool,
    },
    /// Save the cluster's metadata (etcd's whole database: shares, namespaces, layouts,
    /// backup snapshots, members) to FILE, consistent at one revision. Restore it into
    /// a fresh etcd with `etcdctl snapshot restore FILE` (etcd 3.4; `etcdutl` from
    /// 3.5): see docs/cluster.md, "Saving and restoring the metadata". With etcd's
    /// authentication on, connect as its root user.
    EtcdSnapshot {
        #[command(flatten)]
        common: Common,
        /// Where to save it (written whole under a hidden name, then renamed).
        file: PathBuf,
    },
    /// Retire a node: mark it draining (no client places new stripes there), then
    /// move every stripe replica it holds to other nodes, each copied node to node
    /// and verified before its file's layout is changed (compare-and-swap: a file
    /// rewritten meanwhile keeps its new version). Resumable: run it again to finish.
    /// Once it reports nothing remaining, the node can be stopped; `gc` reclaims the
    /// copies left on it. `--cancel` clears the mark.
    Drain {
        #[command(flatten)]
        common: Common,
        #[command(flatten)]
        nodes: NodeArgs,
        /// The node's id.
        node: String,
        /// Clear the node's draining mark instead (it gets new stripes again).
        #[arg(long)]
        cancel: bool,
    },
    /// Even out the stripe replicas over the live nodes (after a node was added):
    /// move replicas from the most loaded nodes to the least until their counts
    /// differ by at most the tolerance, with drain's safety rules. Space on the nodes
    /// moved from is reclaimed by `gc` once the grace period has passed.
    Rebalance {
        #[command(flatten)]
        common: Common,
        #[command(flatten)]
        nodes: NodeArgs,
        /// The largest difference of replica counts left, in percent of the mean count
        /// per node (at least one replica).
        #[arg(long, value_name = "PERCENT", default_value_t = 10)]
        tolerance: u32,
        /// Show the plan; move nothing.
        #[arg(long)]
        dry_run: bool,
    },
    /// Turn on etcd's authentication with Ferry's roles: users root, ferry-admin
    /// (writes everything under /ferry/, e.g. shares), ferry-node (writes
    /// /ferry/nodes/ and /ferry/members/) and ferry-client (writes /ferry/ns/ and
    /// /ferry/shared/), each reading all of /ferry/. Passwords are the first line of
    /// DIR/USER.password, made up (mode 0600) where the file is missing. Once
    /// authentication is on, run it again as etcd's root user (--etcd-user root): it
    /// re-applies the roles and sets each user's password to its file's.
    AuthSetup {
        #[command(flatten)]
        common: Common,
        /// The directory of the users' password files.
        #[arg(long, value_name = "DIR")]
        password_dir: PathBuf,
    },
}

fn main() -> ExitCode {
    let args = Args::parse();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .with_target(false)
        .init();
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            eprintln!("ferry: cannot start the runtime: {e}");
            return ExitCode::from(1);
        }
    };
    let Top::Cluster(command) = args.command;
    match runtime.block_on(run(command)) {
        Ok(code) => ExitCode::from(code),
        Err(e) => {
            eprintln!("ferry: {e}");
            ExitCode::from(match e {
                ClientError::Connect { .. } => 3,
                ClientError::Etcd(e) if e.is_connect() => 3,
                ClientError::Usage(_) | ClientError::Etcd(EtcdError::Config(_)) => 2,
                _ => 1,
            })
        }
    }
}

fn gib(b: u64) -> String {
    format!("{:.1} GiB", b as f64 / (1u64 << 30) as f64)
}

async fn run(command: Command) -> Result<u8, ClientError> {
    match command {
        Command::Status { common } => status_cmd(common).await,
        Command::AddShare {
            common,
            name,
            replicas,
            stripe_mib,
        } => add_share(common, name, replicas, stripe_mib).await,
        Command::Repair { common, nodes } => repair_cmd(common, nodes).await,
        Command::Gc {
            common,
            nodes,
            grace,
            dry_run,
        } => {
            let cluster = nodes.connect(&common).await?;
            let r = gc::gc(&cluster, grace, dry_run).await;
            cluster.close().await;
            let r = r?;
            if common.json {
                println!("{}", serde_json::to_string(&r).expect("report serialises"));
            } else {
                print_gc(&r);
            }
            Ok(if r.failed.is_empty() { 0 } else { 1 })
        }
        Command::AuthSetup {
            common,
            password_dir,
        } => auth_setup_cmd(common, &password_dir).await,
        Command::EtcdSnapshot { common, file } => etcd_snapshot_cmd(common, &file).await,
        Command::Drain {
            common,
            nodes,
            node,
            cancel,
        } => drain_cmd(common, nodes, &node, cancel).await,
        Command::Rebalance {
            common,
            nodes,
            tolerance,
            dry_run,
        } => rebalance_cmd(common, nodes, tolerance, dry_run).await,
    }
}

/// `ferry cluster drain`.
async fn drain_cmd(
    common: Common,
    nodes: NodeArgs,
    node: &str,
    cancel: bool,
) -> Result<u8, ClientError> {
    let cluster = nodes.connect(&common).await?;
    if cancel {
        let r = balance::undrain(&cluster, node).await;
        cluster.close().await;
        r?;
        if common.json {
            println!("{}", serde_json::json!({"node": node, "draining": false}));
        } else {
            println!("node {node}: no longer draining");
        }
        return Ok(0);
    }
    let r = balance::drain(&cluster, node, &std::env::temp_dir()).await;
    cluster.close().await;
    let r = r?;
    if common.json {
        println!("{}", serde_json::to_string(&r).expect("report serialises"));
    } else {
        for f in &r.moved.failed {
            eprintln!("ferry: {f}");
        }
        println!(
            "node {node}: {} stripes moved ({} bytes); {} remaining",
            r.moved.stripes_moved, r.moved.bytes_moved, r.remaining
        );
        if r.remaining == 0 {
            println!("node {node} is drained: no layout names it; it can be stopped");
        } else {
            println!("node {node} still holds stripes: run `ferry cluster drain {node}` again");
        }
    }
    Ok(if r.remaining == 0 { 0 } else { 1 })
}

/// `ferry cluster rebalance`.
async fn rebalance_cmd(
    common: Common,
    nodes: NodeArgs,
    tolerance: u32,
    dry_run: bool,
) -> Result<u8, ClientError> {
    let cluster = nodes.connect(&common).await?;
    let r = balance::rebalance(&cluster, tolerance, dry_run, &std::env::temp_dir()).await;
    cluster.close().await;
    let r = r?;
    if common.json {
        println!("{}", serde_json::to_string(&r).expect("report serialises"));
        return Ok(if r.moved.failed.is_empty() { 0 } else { 1 });
    }
    let verb = if dry_run { "would move" } else { "move" };
    for m in &r.plan {
        println!(
            "{verb} {}/{} stripe {}: {} -> {} ({} bytes)",
            m.share, m.path, m.stripe, m.from, m.to, m.bytes
        );
    }
    for (id, before) in &r.before {
        let after = r.after.get(id).copied().unwrap_or(0);
        println!("node {id}: {before} stripes -> {after}");
    }
    for f in &r.moved.failed {
        eprintln!("ferry: {f}");
    }
    if dry_run {
        println!("{} moves planned (nothing moved)", r.plan.len());
    } else {
        println!(
            "{} stripes moved ({} bytes); `ferry cluster gc` reclaims the old copies after its grace period",
            r.moved.stripes_moved, r.moved.bytes_moved
        );
    }
    Ok(if r.moved.failed.is_empty() { 0 } else { 1 })
}

/// `ferry cluster etcd-snapshot`.
async fn etcd_snapshot_cmd(common: Common, file: &std::path::Path) -> Result<u8, ClientError> {
    let meta = ferry_cluster::Meta::connect(&common.etcd()?).await?;
    let r = ferry_cluster::etcd_snapshot::save(&meta, file).await?;
    if common.json {
        println!("{}", serde_json::to_string(&r).expect("report serialises"));
    } else {
        println!(
            "saved {} bytes of etcd {} at revision {} to {}",
            r.bytes,
            r.etcd_version,
            r.revision,
            r.path.display()
        );
    }
    Ok(0)
}

/// `ferry cluster auth-setup`.
async fn auth_setup_cmd(common: Common, dir: &std::path::Path) -> Result<u8, ClientError> {
    let meta = ferry_cluster::Meta::connect(&common.etcd()?).await?;
    let report = auth_setup::auth_setup(&meta, dir).await?;
    if common.json {
        println!(
            "{}",
            serde_json::to_string(&report).expect("report serialises")
        );
    } else {
        for (user, file) in &report.users {
            let new = if report.created.contains(file) {
                " (new)"
            } else {
                ""
            };
            println!("user {user}: password in {}{new}", file.display());
        }
        println!(
            "etcd authentication is on; from now on connect as root with --etcd-user root --etcd-password-file {}",
            auth_setup::password_file(dir, auth_setup::ROOT_USER).display()
        );
    }
    Ok(0)
}

/// `ferry cluster status`.
async fn status_cmd(common: Common) -> Result<u8, ClientError> {
    let cluster =
        Cluster::connect(&common.etcd()?, TransportChoice::Auto, Credentials::none()).await?;
    let s = status::status(&cluster).await?;
    let healthy = s.under_replicated == 0 && s.unavailable == 0;
    if common.json {
        println!("{}", serde_json::to_string(&s).expect("status serialises"));
    } else {
        println!(
            "{:<12} {:<24} {:<8} {:>12} {:>12} {:>8}",
            "NODE", "ADDRESS", "STATE", "SIZE", "FREE", "STRIPES"
        );
        for n in &s.nodes {
            println!(
                "{:<12} {:<24} {:<8} {:>12} {:>12} {:>8}",
                n.id,
                n.addr,
                n.state(),
                gib(n.capacity),
                gib(n.free),
                n.stripes
            );
        }
        println!(
            "live nodes: {} of {}; space: {} used, {} free of {}",
            s.nodes.iter().filter(|n| n.live).count(),
            s.nodes.len(),
            gib(s.used),
            gib(s.free),
            gib(s.capacity)
        );
        for sh in &s.shares {
            println!(
                "share {}: {} replicas, stripes of {} MiB",
                sh.name,
                sh.replicas,
                sh.stripe_bytes >> 20
            );
        }
        println!(
            "files: {}, stripes: {}, under-replicated: {}, unavailable: {}",
            s.files, s.stripes, s.under_replicated, s.unavailable
        );
        if s.under_replicated > 0 {
            println!("run `ferry cluster repair` to add the missing replicas");
        }
        for n in s.nodes.iter().filter(|n| n.live && n.full) {
            println!(
                "node {}: FULL ({} free, keeps {}): no new stripes go there",
                n.id,
                gib(n.free),
                gib(n.reserve)
            );
        }
    }
    Ok(if healthy { 0 } else { 8 })
}

/// `ferry cluster add-share`.
async fn add_share(
    common: Common,
    name: String,
    replicas: u8,
    stripe_mib: u64,
) -> Result<u8, ClientError> {
    if !ferry_cluster::model::valid_share_name(&name) {
        return Err(ClientError::Usage(format!(
            "{name}: not a valid share name"
        )));
    }
    let config = ShareConfig {
        replicas,
        stripe_bytes: stripe_mib.saturating_mul(STRIPE_ALIGN),
    };
    config.validate().map_err(ClientError::Usage)?;
    let cluster =
        Cluster::connect(&common.etcd()?, TransportChoice::Auto, Credentials::none()).await?;
    cluster.meta().put_share(&name, &config).await?;
    if common.json {
        println!(
            "{}",
            serde_json::json!({"share": name, "replicas": replicas, "stripe_bytes": config.stripe_bytes})
        );
    } else {
        println!("share {name}: {replicas} replicas, stripes of {stripe_mib} MiB");
    }
    Ok(0)
}

/// `ferry cluster repair`, then gc with the default grace period.
async fn repair_cmd(common: Common, nodes: NodeArgs) -> Result<u8, ClientError> {
    let cluster = nodes.connect(&common).await?;
    let scratch = std::env::temp_dir();
    let r = match repair::repair(&cluster, &scratch).await {
        Ok(r) => r,
        Err(e) => {
            cluster.close().await;
            return Err(e);
        }
    };
    let collected = gc::gc(&cluster, gc::DEFAULT_GRACE, false).await;
    cluster.close().await;
    let mut failed = r.failed.len();
    if common.json {
        let mut j = serde_json::to_value(&r).expect("report serialises");
        j["gc"] = match &collected {
            Ok(g) => serde_json::to_value(g).expect("report serialises"),
            Err(e) => serde_json::json!({"error": e.to_string()}),
        };
        println!("{j}");
    } else {
        println!(
            "{} files checked; {} stripes repaired ({} replicas, {} bytes copied); {} unavailable",
            r.files, r.stripes_repaired, r.replicas_added, r.bytes_copied, r.unavailable
        );
        for f in &r.failed {
            eprintln!("ferry: {f}");
        }
        if let Ok(g) = &collected {
            print_gc(g);
        }
    }
    match &collected {
        Ok(g) => failed += g.failed.len(),
        Err(e) => {
            eprintln!("ferry: gc: {e}");
            failed += 1;
        }
    }
    Ok(if failed == 0 { 0 } else { 1 })
}

/// A gc report as text.
fn print_gc(g: &gc::GcReport) {
    let verb = if g.dry_run { "would remove" } else { "removed" };
    for n in &g.nodes {
        match n.state {
            "up" => {
                for o in &n.removed_objects {
                    println!("{}: {verb} {o}", n.id);
                }
                println!(
                    "node {}: {} objects ({} bytes); kept {} ({} within the grace period); {verb} {} ({} bytes)",
                    n.id, n.found.objects, n.found.bytes, n.kept.objects, n.young.objects,
                    n.removed.objects, n.removed.bytes
                );
            }
            "down" => println!("node {}: down, not collected", n.id),
            _ => {}
        }
    }
    println!(
        "gc (grace {}s): {} objects on the live nodes; kept {}; {verb} {} objects, {} bytes",
        g.grace_secs, g.found.objects, g.kept.objects, g.removed.objects, g.removed.bytes
    );
    for f in &g.failed {
        eprintln!("ferry: gc: {f}");
    }
}
