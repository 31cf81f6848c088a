//! `ferryd`: serve shares to Ferry clients.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context;
use clap::Parser;
use ferry_common::msg::HashAlgorithm;
use ferry_common::seal::Encryption;
use ferry_common::transport::TransportChoice;
use ferry_server::{Config, Server};

#[cfg(feature = "cluster")]
mod cluster;

/// The end of `ferryd --help`.
const AFTER_HELP: &str = "\
EXAMPLES:
  ferryd --generate-secret /etc/ferry/data.secret
  ferryd --share data=/srv/data --secret-file /etc/ferry/data.secret
  ferryd --share data=/srv/data --share pub=/srv/pub:ro \\
         --secret-file data=/etc/ferry/data.secret --secret-file pub=/etc/ferry/pub.secret \\
         --listen 0.0.0.0:7447
  ferryd --config /etc/ferryd.toml
  ferryd --config /etc/ferryd.toml --check-config   # check it, serve nothing

SECRETS:
  Every share has a secret; a client proves it knows it (HMAC-SHA256 challenge-
  response over fresh nonces from both sides) before it may use the share. Secrets
  come from files (mode 0600 or stricter, owned by ferryd's user or root) or from
  the environment ($FERRYD_SECRET for every share without its own), never from the
  command line. Clients give theirs with rcp --secret-file or $FERRY_SECRET_FILE.

CONFIG FILE (TOML):
  listen = \"127.0.0.1:7447\"
  queue_depth = 16
  max_mapped_bytes = 68719476736
  partial_ttl = \"24h\"
  max_connections = 1024
  max_startups = \"128:30:256\"           # unauthenticated connections: START:RATE:FULL
  max_startups_per_source = 64
  startup_timeout = \"10s\"                # to authenticate, from accept
  max_auth_failures = \"10/60s\"           # per address, then refused for a while
  encryption = \"required\"                # default for shares: required|preferred|off
  rekey_after = \"64G\"                     # new keys after this much sent under one,
  rekey_interval = \"1h\"                   # or this long, whichever first
  [[share]]
  name = \"data\"
  path = \"/srv/data\"
  read_only = false
  secret_file = \"/etc/ferry/data.secret\"   # or: secret_env = \"DATA_SECRET\"
  encryption = \"required\"                # this share's own policy

ENCRYPTION:
  Sessions are encrypted and authenticated (X25519 key exchange with fresh keys per
  session, bound to the share's secret; AES-256-GCM, or ChaCha20-Poly1305 on CPUs
  without AES instructions): control messages and every byte of file data, on TCP
  and RDMA. Per share: required (the default: a client that does not encrypt is
  refused), preferred (encrypted when the client supports it) or off (ferryd does
  not ask for it; a client that requires it still gets it). See docs/security.md.

ADMISSION:
  A connection counts against --max-connections from accept. Until it authenticates
  it is also a startup: one address may hold --max-startups-per-source of them, all
  addresses together are refused at random and then all as --max-startups nears its
  FULL (so an idle flood leaves the other slots to real sessions), and one that has
  not authenticated within --startup-timeout is closed. An address with more failed
  authentications than --max-auth-failures allows is refused for a while. Each
  refusal is told to the client, which prints it.";

/// Environment variable holding the secret of every share that has no other.
const DEFAULT_SECRET_ENV: &str = "FERRYD_SECRET";

/// How long connections may take to wind down after SIGINT/SIGTERM.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(5);

/// Ferry file server: exports directories ("shares") to rcp clients. File data moves
/// by one-sided RDMA READ/WRITE of registered memory (emulated over TCP where no RDMA
/// device exists); every chunk is verified against its hash (BLAKE3, or SHA-256 where
/// a share or client asks for it).
#[derive(Parser, Debug)]
#[command(
    name = "ferryd",
    version,
    after_help = AFTER_HELP
)]
struct Args {
    /// TOML configuration file (shares, listen address, queue depth, mapped-byte budget).
    #[arg(long, value_name = "FILE")]
    config: Option<PathBuf>,

    /// Export a share: NAME=PATH, or NAME=PATH:ro for read-only. Repeatable.
    #[arg(long = "share", value_name = "NAME=PATH[:ro]")]
    shares: Vec<String>,

    /// A share's secret file: NAME=FILE for one share, or FILE for every share without
    /// its own. The file must not be accessible by group or others. Repeatable.
    #[arg(long = "secret-file", value_name = "[NAME=]FILE")]
    secret_files: Vec<String>,

    /// Whose files a share's entries are: NAME=client (the calling users', ferryd
    /// running as root) or NAME=server (ferryd's, the default), then any of
    /// no_root_squash, allow_devices, allow_setid (comma-separated). Repeatable.
    #[arg(long = "owners", value_name = "NAME=client|server[,OPTION...]")]
    owners: Vec<String>,

    /// Serve shares that have no secret to anyone who can connect (for a lab or a
    /// demo on loopback; logged as a warning).
    #[arg(long)]
    insecure_no_auth: bool,

    /// Write a new random secret (32 bytes, hex) to FILE with mode 0600 and exit. FILE
    /// must not exist.
    #[arg(long, value_name = "FILE", exclusive = true)]
    generate_secret: Option<PathBuf>,

    /// Check the configuration (the file, the flags and the environment: shares and
    /// their roots, secrets, owners, limits, cluster settings) and exit without
    /// serving: 0 and a summary on standard output if ferryd would start with it, 2
    /// (1 for other failures) and what is wrong if not. Nothing is created or changed.
    #[arg(long)]
    check_config: bool,

    /// Address (or host name) and port to listen on [default: 127.0.0.1:7447]. Port 0
    /// picks one free for TCP and, under `--transport auto`, for RDMA as well.
    #[arg(long, value_name = "ADDR:PORT", value_parser = parse_listen)]
    listen: Option<SocketAddr>,

    /// Once listening, write the actual ADDR:PORT to this file (atomically).
    #[arg(long, value_name = "FILE")]
    port_file: Option<PathBuf>,

    /// Chunks in flight per connection (bounds per-connection memory) [default: 16].
    #[arg(long, value_name = "N")]
    queue_depth: Option<usize>,

    /// Most file bytes registered for mapped files (MapOpen) at once, over all
    /// connections; opens beyond it are refused as busy. Bytes, or with a K, M, G or T
    /// suffix (powers of 1024) [default: 64G].
    #[arg(long, value_name = "SIZE", value_parser = parse_size)]
    max_mapped_bytes: Option<u64>,

    /// At start, remove resumable partial uploads (left by interrupted uploads) not
    /// written to for this long: seconds, or with an s, m, h or d suffix; 0 removes them
    /// all [default: 24h].
    #[arg(long, value_name = "DURATION", value_parser = parse_duration)]
    partial_ttl: Option<Duration>,
    /// Most connections served at once, TCP and RDMA together, counted from accept
    /// until closed; one more is told the server is at its limit and closed
    /// [default: 1024].
    #[arg(long, value_name = "N")]
    max_connections: Option<usize>,

    /// Limits on connections that have not authenticated yet, over all addresses (as
    /// sshd's MaxStartups): from START of them on, RATE % of new ones are refused,
    /// rising to all at FULL; FULL alone refuses every one beyond it. Capped at
    /// --max-connections; the slots above FULL are kept for authenticated sessions
    /// [default: 128:30:256].
    #[arg(long, value_name = "START:RATE:FULL")]
    max_startups: Option<ferry_server::admission::MaxStartups>,

    /// Most connections that have not authenticated yet from one address; more are
    /// refused as busy [default: 64].
    #[arg(long, value_name = "N", value_parser = ferry_server::admission::parse_per_source)]
    max_startups_per_source: Option<u32>,

    /// How long after accept a connection may take to authenticate (transport set-up,
    /// handshake and proof) before it is closed: seconds, or with an s, m or h suffix
    /// [default: 10s].
    #[arg(long, value_name = "DURATION", value_parser = ferry_server::admission::parse_startup_timeout)]
    startup_timeout: Option<Duration>,

    /// Failed authentications one address may have: N at once, refilling N per
    /// DURATION; beyond them, its connections are refused ("too many failed
    /// authentications from ADDR, retry in S s") until one has refilled
    /// [default: 10/60s].
    #[arg(long, value_name = "N/DURATION")]
    max_auth_failures: Option<ferry_server::admission::FailureLimit>,

    /// Chunk-hash algorithm the data of every share without its own `hash` setting is
    /// recorded in: `blake3` or `sha256`. Unset: the client's preference (BLAKE3 where
    /// it has it). Files recorded in either are always verified with their own.
    #[arg(long, value_name = "blake3|sha256")]
    hash: Option<HashAlgorithm>,

    /// Encryption policy of every share without its own `encryption` setting:
    /// `required` (clients that do not encrypt are refused), `preferred` (encrypted
    /// when the client supports it; older clients in the clear) or `off` (never asked
    /// for) [default: required, or the config file's top-level `encryption`].
    #[arg(long, value_name = "required|preferred|off", env = "FERRYD_ENCRYPTION")]
    encryption: Option<Encryption>,

    /// In encrypted sessions with clients that support it, move to new keys for what
    /// ferryd sends after this many bytes under one key (K, M, G, T suffixes), or
    /// after --rekey-interval, whichever first [default: 64G].
    #[arg(long, value_name = "SIZE", value_parser = parse_size, env = "FERRYD_REKEY_AFTER")]
    rekey_after: Option<u64>,

    /// The time part of --rekey-after: seconds, or with an s, m, h or d suffix
    /// [default: 1h].
    #[arg(long, value_name = "DURATION", value_parser = parse_duration)]
    rekey_interval: Option<Duration>,

    /// Transports to serve: `auto` serves TCP and, where an RDMA device exists, RDMA
    /// on the same address and port; `rdma` serves RDMA only (and fails without a
    /// device); `tcp` serves the TCP transport only. RDMA needs the address of an
    /// RDMA-capable interface (not 127.0.0.1) for clients to reach it.
    #[arg(
        long,
        value_name = "auto|rdma|tcp",
        default_value = "auto",
        env = "FERRY_TRANSPORT"
    )]
    transport: TransportChoice,

    /// Join the Ferry cluster whose etcd is at ENDPOINTS (HOST:PORT or URLs,
    /// comma-separated) as a storage node: registers this ferryd under a lease and
    /// serves the stripes of cluster shares from --store. Needs --node-id and --store.
    /// etcd over TLS or with a user: the --etcd-* options below, or the cluster
    /// configuration file (--cluster-config).
    #[cfg_attr(feature = "cluster", arg(long, value_name = "ENDPOINTS", requires_all = ["node_id", "store"], env = "FERRYD_CLUSTER"))]
    #[cfg_attr(
        not(feature = "cluster"),
        arg(long, value_name = "ENDPOINTS", env = "FERRYD_CLUSTER")
    )]
    cluster: Option<String>,

    /// etcd's TLS and user settings (with --cluster).
    #[cfg(feature = "cluster")]
    #[command(flatten)]
    etcd: ferry_cluster::EtcdArgs,

    /// This node's id in the cluster (unique; keep it across restarts).
    #[cfg(feature = "cluster")]
    #[arg(long, value_name = "ID", value_parser = parse_node_id)]
    node_id: Option<String>,

    /// Directory holding this node's stripe objects (exported as the share `cluster`,
    /// guarded by the cluster's secret: --secret-file or $FERRYD_SECRET).
    #[cfg(feature = "cluster")]
    #[arg(long, value_name = "DIR")]
    store: Option<PathBuf>,

    /// Seconds the node's registration outlives its last renewal: a node that dies
    /// drops out of the cluster after this long.
    #[cfg(feature = "cluster")]
    #[arg(long, value_name = "SECS", default_value_t = ferry_cluster::model::DEFAULT_LEASE_TTL_SECS, value_parser = clap::value_parser!(i64).range(2..=3600))]
    lease_ttl: i64,

    /// Free space this node keeps in its store's file system: with no more free than
    /// this it reports itself full and clients place no new stripes on it
    /// (`ferry cluster status` says FULL). A percentage of the file system (`2%`) or a
    /// size (`10G`, `512M`).
    #[cfg(feature = "cluster")]
    #[arg(long, value_name = "PERCENT|SIZE", default_value = cluster::DEFAULT_MIN_FREE, value_parser = cluster::MinFree::parse)]
    min_free: cluster::MinFree,

    /// The address clients and other nodes reach this node at (default: --listen's,
    /// which must then not be a wildcard address).
    #[cfg(feature = "cluster")]
    #[arg(long, value_name = "HOST:PORT")]
    advertise: Option<String>,

    /// More log output (repeat for more). RUST_LOG overrides.
    #[arg(short, long, action = clap::ArgAction::Count)]
    verbose: u8,
}

#[cfg(feature = "cluster")]
fn parse_node_id(s: &str) -> Result<String, String> {
    if ferry_cluster::model::valid_node_id(s) {
        Ok(s.to_owned())
    } else {
        Err("node ids are 1-64 letters, digits, '-', '_' or '.', not starting with '.'".into())
    }
}

fn main() -> ExitCode {
    let args = Args::parse();
    init_logging(args.verbose);
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            eprintln!("ferryd: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(run(args)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("ferryd: {e:#}");
            ExitCode::from(if e.is::<ferry_server::ConfigError>() {
                2
            } else {
                1
            })
        }
    }
}

/// With `--cluster`: etcd's settings (the endpoints, with the TLS and user settings
/// of the options and the cluster configuration file) put in `config`, for the
/// node's registration and `Replicate`.
#[cfg(feature = "cluster")]
fn cluster_node(args: &Args, config: &mut Config) -> anyhow::Result<()> {
    let Some(endpoints) = &args.cluster else {
        return Ok(());
    };
    let endpoints = endpoints.split(',').map(str::to_owned).collect();
    let etcd = args.etcd.resolve(Some(endpoints)).context("--cluster")?;
    config.cluster = Some(ferry_server::ClusterNode {
        etcd,
        transport: args.transport,
    });
    Ok(())
}

fn init_logging(verbose: u8) {
    let default = match verbose {
        0 => "info",
        1 => "debug",
        _ => "trace",
    };
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_target(false)
        .init();
}

async fn run(args: Args) -> anyhow::Result<()> {
    if let Some(path) = &args.generate_secret {
        generate_secret(path)
            .with_context(|| format!("cannot write a secret to {}", path.display()))?;
        eprintln!("ferryd: wrote a new secret to {}", path.display());
        return Ok(());
    }
    #[cfg(not(feature = "cluster"))]
    if args.cluster.is_some() {
        anyhow::bail!(
            "--cluster: this ferryd was built without cluster support (cargo feature `cluster`)"
        );
    }
    #[allow(unused_mut)] // Only `cluster_node` changes it (feature `cluster`).
    let mut config = build_config(&args)?;
    #[cfg(feature = "cluster")]
    cluster_node(&args, &mut config)?;
    let server = Server::new(&config)?;
    if args.check_config {
        print!("{}", config_summary(&config, &server));
        return Ok(());
    }
    // Stale hidden files of a killed ferryd go in the background: a large share must
    // not delay serving, and nothing a live transfer uses is touched.
    let cleaner = server.clone();
    tokio::task::spawn_blocking(move || cleaner.clean_stale_files());
    let listeners = listen(args.transport, config.listen)?;
    let local = listeners.local;
    log_shares(&config, &server);
    if let Some(path) = &args.port_file {
        write_port_file(path, local)
            .with_context(|| format!("cannot write port file {}", path.display()))?;
    }
    tracing::info!(
        "ferryd listening on {local} (transport {}: {})",
        args.transport,
        listeners.describe()
    );
    let mut serving = Vec::new();
    #[cfg(feature = "cluster")]
    if let (Some(etcd), Some(id), Some(store)) =
        (server.cluster_etcd().cloned(), &args.node_id, &args.store)
    {
        let addr = match &args.advertise {
            Some(a) => a.clone(),
            None if local.ip().is_unspecified() => anyhow::bail!(
                "--cluster: listening on {local}, a wildcard address; give the address nodes and clients reach this one at with --advertise HOST:PORT"
            ),
            None => local.to_string(),
        };
        let mut transports = Vec::new();
        if listeners.tcp.is_some() {
            transports.push("tcp".to_owned());
        }
        #[cfg(feature = "rdma")]
        if listeners.rdma.is_some() {
            transports.push("rdma".to_owned());
        }
        serving.push(tokio::spawn(cluster::join(
            etcd,
            id.clone(),
            addr,
            transports,
            store.clone(),
            (args.lease_ttl, args.min_free),
        )));
    }
    if let Some(tcp) = listeners.tcp {
        serving.push(tokio::spawn(server.clone().serve_tcp(tcp)));
    }
    #[cfg(feature = "rdma")]
    if let Some(rdma) = listeners.rdma {
        serving.push(tokio::spawn(server.clone().serve_rdma(rdma)));
    }
    wait_for_signal().await?;
    tracing::info!("shutting down");
    let left = server.shutdown(SHUTDOWN_GRACE).await;
    if left > 0 {
        tracing::warn!("{left} connections still open after {SHUTDOWN_GRACE:?}; exiting anyway");
    }
    for s in serving {
        s.abort();
    }
    Ok(())
}

/// The configuration the command line asks for (the configuration file, if any,
/// with the flags on top); raises the open-files limit to serve it.
fn build_config(args: &Args) -> anyhow::Result<Config> {
    #[allow(unused_mut)] // Only --store (feature `cluster`) adds a share.
    let mut shares = args.shares.clone();
    #[cfg(feature = "cluster")]
    if let Some(store) = &args.store {
        if args.check_config && !store.is_dir() {
            // ferryd would create it; checking changes nothing.
            anyhow::bail!(
                "--store {}: not a directory yet (ferryd creates it when it starts)",
                store.display()
            );
        }
        std::fs::create_dir_all(store)
            .with_context(|| format!("cannot create the store {}", store.display()))?;
        shares.push(format!(
            "{}={}",
            ferry_cluster::model::STORE_SHARE,
            store.display()
        ));
    }
    let mut config = Config::build(
        args.config.as_deref(),
        args.listen,
        args.queue_depth,
        args.max_mapped_bytes,
        args.partial_ttl,
        args.max_connections,
        &shares,
    )?;
    raise_fd_limit(config.max_connections);
    apply_admission(args, &mut config);
    let default_env = std::env::var_os(DEFAULT_SECRET_ENV).map(|_| DEFAULT_SECRET_ENV);
    config.apply_secrets(&args.secret_files, default_env)?;
    config.apply_owners(&args.owners)?;
    config.insecure_no_auth = args.insecure_no_auth;
    for share in config.shares.iter_mut().filter(|s| s.hash.is_none()) {
        share.hash = args.hash;
    }
    if let Some(e) = args.encryption {
        config.encryption = e;
    }
    config.rekey.after_bytes = args.rekey_after.unwrap_or(config.rekey.after_bytes);
    config.rekey.after = args.rekey_interval.unwrap_or(config.rekey.after);
    Ok(config)
}

/// Puts the admission flags given over the configuration file's settings.
fn apply_admission(args: &Args, config: &mut Config) {
    let a = &mut config.admission;
    if let Some(m) = args.max_startups {
        a.max_startups = m;
    }
    if let Some(n) = args.max_startups_per_source {
        a.per_source = n;
    }
    if let Some(t) = args.startup_timeout {
        a.startup_timeout = t;
    }
    if let Some(f) = args.max_auth_failures {
        a.auth_failures = f;
    }
}

/// What `--check-config` prints: the shares as ferryd would serve them, and the
/// limits.
fn config_summary(config: &Config, server: &Server) -> String {
    let mut out = String::from("configuration OK\n");
    for s in &config.shares {
        out.push_str(&format!(
            "share {}: {} ({}, {}, encryption {})\n",
            s.name,
            s.path.display(),
            if s.read_only {
                "read-only"
            } else {
                "read-write"
            },
            if server.is_open(&s.name) {
                "NO SECRET"
            } else {
                "secret"
            },
            s.encryption.unwrap_or(config.encryption).as_str(),
        ));
    }
    out.push_str(&format!(
        "listen {}, at most {} connections\n",
        config.listen, config.max_connections
    ));
    if let Some(node) = &config.cluster {
        out.push_str(&format!("cluster node, transport {}\n", node.transport));
    }
    out
}

/// Logs the shares served, warning of those served without a secret.
fn log_shares(config: &Config, server: &Server) {
    for s in &config.shares {
        tracing::info!(
            share = %s.name,
            path = %s.path.display(),
            read_only = s.read_only,
            hash = s.hash.map_or("client's choice", |h| h.name()),
            encryption = s.encryption.unwrap_or(config.encryption).as_str(),
            secret = !server.is_open(&s.name),
            "exporting share"
        );
        if server.is_open(&s.name) {
            tracing::warn!(
                share = %s.name,
                "share served WITHOUT a secret (--insecure-no-auth): anyone who can connect may use it"
            );
        }
    }
}

/// The listeners `--transport` asked for, bound.
struct Listeners {
    local: SocketAddr,
    tcp: Option<tokio::net::TcpListener>,
    #[cfg(feature = "rdma")]
    rdma: Option<ferry_common::transport::rdma::Listener>,
    /// What RDMA is doing, for the start-up line.
    rdma_note: String,
}

impl Listeners {
    fn describe(&self) -> String {
        match &self.tcp {
            Some(_) => format!("tcp, {}", self.rdma_note),
            None => self.rdma_note.clone(),
        }
    }
}

/// How many ports ferryd tries when `--listen` gives port 0 and serves both transports.
/// TCP and the RDMA connection manager keep separate port spaces: a port the kernel
/// hands out as free for TCP may be held in the RDMA space (by a listener, or by an
/// outgoing RDMA connection's ephemeral port), and then the next one is tried.
#[cfg(feature = "rdma")]
const EPHEMERAL_PORT_ATTEMPTS: usize = 32;

fn listen(choice: TransportChoice, addr: SocketAddr) -> anyhow::Result<Listeners> {
    match choice {
        TransportChoice::Tcp => {
            let (tcp, local) = bind_tcp(addr)?;
            Ok(Listeners {
                local,
                tcp: Some(tcp),
                #[cfg(feature = "rdma")]
                rdma: None,
                rdma_note: "rdma off".into(),
            })
        }
        TransportChoice::Auto | TransportChoice::Rdma => listen_rdma(choice, addr),
    }
}

/// A tokio TCP listener on `addr`, and the address it got.
fn bind_tcp(addr: SocketAddr) -> anyhow::Result<(tokio::net::TcpListener, SocketAddr)> {
    let bound = std::net::TcpListener::bind(addr)
        .and_then(|l| {
            l.set_nonblocking(true)?;
            Ok(l)
        })
        .with_context(|| format!("cannot listen on {addr}"))?;
    let local = bound
        .local_addr()
        .context("cannot read the bound address")?;
    let tcp = tokio::net::TcpListener::from_std(bound).context("cannot register the listener")?;
    Ok((tcp, local))
}

#[cfg(not(feature = "rdma"))]
fn listen_rdma(choice: TransportChoice, addr: SocketAddr) -> anyhow::Result<Listeners> {
    if choice == TransportChoice::Rdma {
        anyhow::bail!("this ferryd was built without the rdma feature");
    }
    let (tcp, local) = bind_tcp(addr)?;
    Ok(Listeners {
        local,
        tcp: Some(tcp),
        rdma_note: "no rdma: built without the rdma feature".into(),
    })
}

#[cfg(feature = "rdma")]
fn listen_rdma(choice: TransportChoice, addr: SocketAddr) -> anyhow::Result<Listeners> {
    use ferry_common::transport::{rdma, TransportError};
    let devices = rdma::available();
    if choice == TransportChoice::Rdma {
        let serving = devices.and_then(|d| Ok((rdma::Listener::bind(addr)?, d)));
        let (l, devices) =
            serving.map_err(|e| anyhow::anyhow!("cannot serve RDMA on {addr}: {e}"))?;
        let mut local = addr;
        local.set_port(l.local_port());
        return Ok(Listeners {
            local,
            tcp: None,
            rdma_note: format!("rdma on {}", devices.join(",")),
            rdma: Some(l),
        });
    }
    let devices = match devices {
        Ok(d) => d,
        Err(e) => {
            let (tcp, local) = bind_tcp(addr)?;
            return Ok(Listeners {
                local,
                tcp: Some(tcp),
                rdma: None,
                rdma_note: format!("no rdma: {e}"),
            });
        }
    };
    // Port 0 means any port: keep looking for one free in both spaces. A port given
    // by the user is theirs to choose; if RDMA cannot have it, TCP alone serves.
    let attempts = if addr.port() == 0 {
        EPHEMERAL_PORT_ATTEMPTS
    } else {
        1
    };
    let taken = |e: &TransportError| {
        matches!(e, TransportError::Io { source, .. }
            if source.kind() == std::io::ErrorKind::AddrInUse)
    };
    let (tcp, local, rdma) = bind_pair(attempts, || bind_tcp(addr), rdma::Listener::bind, taken)?;
    Ok(match rdma {
        Ok(l) => Listeners {
            local,
            tcp: Some(tcp),
            rdma: Some(l),
            rdma_note: format!("rdma on {}", devices.join(",")),
        },
        Err(e) => {
            tracing::warn!("serving TCP only on {local}: RDMA cannot listen there: {e}");
            Listeners {
                local,
                tcp: Some(tcp),
                rdma: None,
                rdma_note: format!("no rdma: {e}"),
            }
        }
    })
}

/// Binds `first` (on an address of its choosing), then `second` on the address `first`
/// got, up to `attempts` times while `second` fails with an error `taken` says is the
/// address being in use; returns the last attempt, `second`'s error included.
///
/// Invariant: every rejected `first` stays bound until this returns, so it cannot be
/// handed out again within the search.
#[cfg_attr(not(feature = "rdma"), allow(dead_code))]
fn bind_pair<A, B, E, X>(
    attempts: usize,
    mut first: impl FnMut() -> Result<(A, SocketAddr), X>,
    mut second: impl FnMut(SocketAddr) -> Result<B, E>,
    taken: impl Fn(&E) -> bool,
) -> Result<(A, SocketAddr, Result<B, E>), X> {
    let mut rejected = Vec::new();
    loop {
        let (a, at) = first()?;
        let b = second(at);
        match b {
            Err(e) if taken(&e) && rejected.len() + 1 < attempts => {
                tracing::debug!("{at} is taken for RDMA; trying another port");
                rejected.push(a);
            }
            b => return Ok((a, at, b)),
        }
    }
}

/// A duration for `--partial-ttl`.
fn parse_duration(arg: &str) -> Result<Duration, String> {
    ferry_server::config::parse_duration(arg).map_err(|e| e.to_string())
}

/// Raises the soft limit on open files to the hard limit, as far as it goes: each
/// connection holds at least one descriptor (more while it has transfers and mapped
/// files open), and the usual soft limit of 1024 would make accept fail (EMFILE) before
/// `max_connections` is reached. Warns if the result is still low for the limit.
fn raise_fd_limit(max_connections: usize) {
    use nix::sys::resource::{getrlimit, setrlimit, Resource};
    let Ok((soft, hard)) = getrlimit(Resource::RLIMIT_NOFILE) else {
        return;
    };
    let soft = if soft < hard && setrlimit(Resource::RLIMIT_NOFILE, hard, hard).is_ok() {
        hard
    } else {
        soft
    };
    // A connection's socket plus an open upload or mapped file or two, and the
    // server's own descriptors.
    let wanted = (max_connections as u64)
        .saturating_mul(2)
        .saturating_add(64);
    if soft < wanted {
        tracing::warn!(
            "the open-file limit is {soft}: with --max-connections {max_connections}, \
             accepts may fail for lack of descriptors (raise `ulimit -n` to at least {wanted})"
        );
    }
}

/// A byte size for `--max-mapped-bytes`.
fn parse_size(arg: &str) -> Result<u64, String> {
    ferry_server::config::parse_size(arg).map_err(|e| e.to_string())
}

/// `ADDR:PORT`, or `HOST:PORT` resolved to its first address.
fn parse_listen(arg: &str) -> Result<SocketAddr, String> {
    use std::net::ToSocketAddrs;
    if let Ok(addr) = arg.parse() {
        return Ok(addr);
    }
    arg.to_socket_addrs()
        .map_err(|e| format!("cannot resolve '{arg}': {e}"))?
        .next()
        .ok_or_else(|| format!("'{arg}' resolves to no address"))
}

/// Writes 32 random bytes, hex-encoded, to a new file of mode 0600.
fn generate_secret(path: &Path) -> std::io::Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let nonce = ferry_common::auth::fresh_nonce();
    let hex: String = nonce.iter().map(|b| format!("{b:02x}")).collect();
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)?;
    f.write_all(format!("{hex}\n").as_bytes())?;
    f.sync_all()
}

fn write_port_file(path: &Path, addr: SocketAddr) -> std::io::Result<()> {
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(".tmp");
    std::fs::write(&tmp, format!("{addr}\n"))?;
    std::fs::rename(&tmp, path)
}

async fn wait_for_signal() -> anyhow::Result<()> {
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = signal(SignalKind::terminate()).context("cannot watch SIGTERM")?;
    tokio::select! {
        r = tokio::signal::ctrl_c() => r.context("cannot watch SIGINT")?,
        _ = term.recv() => {}
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::cell::RefCell;
    use std::net::SocketAddr;
    use std::rc::Rc;

    use super::bind_pair;

    /// Stands for a bound TCP listener: records its port when dropped (unbound).
    struct Bound(u16, Rc<RefCell<Vec<u16>>>);

    impl Drop for Bound {
        fn drop(&mut self) {
            self.1.borrow_mut().push(self.0);
        }
    }

    #[derive(Debug, PartialEq)]
    enum Fail {
        Taken(u16),
        Other(u16),
    }

    /// Runs `bind_pair` with `first` handing out ports 40000, 40001, ... and `second`
    /// answering `verdict(port)`; returns the result's port and `second`'s answer, and
    /// the ports unbound by the time it returned.
    fn run(
        attempts: usize,
        verdict: impl Fn(u16) -> Result<(), Fail>,
    ) -> (u16, Result<(), Fail>, Vec<u16>) {
        let dropped = Rc::new(RefCell::new(Vec::new()));
        let mut next = 40000u16;
        let first = || -> Result<(Bound, SocketAddr), ()> {
            let port = next;
            next += 1;
            Ok((
                Bound(port, dropped.clone()),
                SocketAddr::from(([127, 0, 0, 1], port)),
            ))
        };
        let second = |at: SocketAddr| {
            assert!(
                dropped.borrow().is_empty(),
                "a rejected port was unbound during the search"
            );
            verdict(at.port())
        };
        let taken = |e: &Fail| matches!(e, Fail::Taken(_));
        let (bound, at, answer) = bind_pair(attempts, first, second, taken).unwrap();
        assert_eq!(bound.0, at.port());
        let unbound = dropped.borrow().clone();
        (at.port(), answer, unbound)
    }

    #[test]
    fn moves_past_ports_taken_for_the_second_listener() {
        let (port, answer, unbound) = run(32, |p| {
            if p < 40002 {
                Err(Fail::Taken(p))
            } else {
                Ok(())
            }
        });
        assert_eq!((port, answer), (40002, Ok(())));
        assert_eq!(unbound, vec![40000, 40001]);
    }

    #[test]
    fn gives_the_last_error_when_every_attempt_is_taken() {
        let (port, answer, _) = run(3, |p| Err(Fail::Taken(p)));
        assert_eq!((port, answer), (40002, Err(Fail::Taken(40002))));
        let (port, answer, unbound) = run(1, |p| Err(Fail::Taken(p)));
        assert_eq!(
            (port, answer, unbound),
            (40000, Err(Fail::Taken(40000)), vec![])
        );
    }

    #[test]
    fn stops_at_an_error_other_than_taken() {
        let (port, answer, unbound) = run(32, |p| Err(Fail::Other(p)));
        assert_eq!(
            (port, answer, unbound),
            (40000, Err(Fail::Other(40000)), vec![])
        );
    }

    #[test]
    fn a_failing_first_bind_is_returned() {
        let first = || -> Result<((), SocketAddr), &str> { Err("no") };
        let got = bind_pair(4, first, |_| Ok::<(), ()>(()), |_| true);
        assert_eq!(got.err(), Some("no"));
    }
}
