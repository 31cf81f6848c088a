//! `ferry`: administration of a Ferry cluster (`ferry cluster status|add-share|repair`).

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use ferry_client::cluster::{auth_setup, repair, status, Cluster, EtcdArgs, EtcdConfig, EtcdError};
use ferry_client::{ClientError, Credentials};
use ferry_common::cluster::{ShareConfig, STRIPE_ALIGN};
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
  0  success (status: every stripe has its replicas; repair: nothing left to do)
  1  an error (etcd or a node unreachable, a stripe that could not be repaired)
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
        #[arg(long, default_value_t = ferry_common::cluster::DEFAULT_REPLICAS)]
        replicas: u8,
        /// Stripe size in MiB.
        #[arg(long, default_value_t = ferry_common::cluster::DEFAULT_STRIPE_BYTES >> 20)]
        stripe_mib: u64,
    },
    /// Give every under-replicated stripe new replicas on live nodes (after a node
    /// was lost), copied from a live replica and verified.
    Repair {
        #[command(flatten)]
        common: Common,
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
        Command::Repair {
            common,
            secret_file,
            transport,
            encryption,
        } => {
            let creds =
                Credentials::from_file_or_env(secret_file.as_deref())?.with_encryption(encryption);
            repair_cmd(common, transport, creds).await
        }
        Command::AuthSetup {
            common,
            password_dir,
        } => auth_setup_cmd(common, &password_dir).await,
    }
}

/// `ferry cluster auth-setup`.
async fn auth_setup_cmd(common: Common, dir: &std::path::Path) -> Result<u8, ClientError> {
    let meta = ferry_client::cluster::Meta::connect(&common.etcd()?).await?;
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
            "{:<12} {:<24} {:<6} {:>12} {:>12} {:>8}",
            "NODE", "ADDRESS", "STATE", "SIZE", "FREE", "STRIPES"
        );
        for n in &s.nodes {
            println!(
                "{:<12} {:<24} {:<6} {:>12} {:>12} {:>8}",
                n.id,
                n.addr,
                if n.live { "up" } else { "DOWN" },
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
    if !ferry_common::cluster::valid_share_name(&name) {
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

/// `ferry cluster repair`.
async fn repair_cmd(
    common: Common,
    transport: TransportChoice,
    creds: Credentials,
) -> Result<u8, ClientError> {
    let cluster = Cluster::connect(&common.etcd()?, transport, creds).await?;
    let scratch = std::env::temp_dir();
    let r = repair::repair(&cluster, &scratch).await?;
    cluster.close().await;
    if common.json {
        println!("{}", serde_json::to_string(&r).expect("report serialises"));
    } else {
        println!(
            "{} files checked; {} stripes repaired ({} replicas, {} bytes copied); {} unavailable",
            r.files, r.stripes_repaired, r.replicas_added, r.bytes_copied, r.unavailable
        );
        for f in &r.failed {
            eprintln!("ferry: {f}");
        }
    }
    Ok(if r.failed.is_empty() { 0 } else { 1 })
}
