//! `rcp`: copy files and trees to and from ferryd.

use std::io::IsTerminal;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Instant;

use clap::Parser;

mod cli;

use cli::exit;
use cli::progress::{progress_bar, Bar};
use ferry_client::copy::{self, CopyOptions, Report};
use ferry_client::error::ClientError;
use ferry_client::location::{self, Location, Remote};
use ferry_client::progress::Progress;
use ferry_client::{Client, Credentials};
use ferry_common::msg::HashAlgorithm;
use ferry_common::seal::Encryption;
use ferry_common::transport::TransportChoice;

/// The end of `rcp --help`.
const AFTER_HELP: &str = "\
REMOTE PATHS:
  HOST[:PORT]:SHARE[/PATH]    e.g. storage1:backups/db.dump, 10.0.0.5:7447:data/x
  [IPv6]:PORT:SHARE[/PATH]    e.g. [::1]:7447:data/x
  An operand is remote if it has a ':' before any '/'. Default port 7447.
  cluster://ETCD_HOST[:PORT]/SHARE[/PATH]
                              a cluster share: files striped and replicated over
                              the storage nodes that etcd lists (default port 2379);
                              the secret is the cluster's. See `ferry cluster --help`.
                              etcd over TLS and with a user: --etcd-ca, --etcd-cert,
                              --etcd-key, --etcd-user, --etcd-password-file, or the
                              cluster configuration file (--cluster-config FILE,
                              $FERRY_CLUSTER_CONFIG, /etc/ferry/cluster.toml).

SECRETS:
  Each share has a secret, which rcp proves to the server without sending it.
  Give it as a file (mode 0600): --secret-file FILE or $FERRY_SECRET_FILE, or in
  $FERRY_SECRET. Never on the command line.

EXAMPLES:
  rcp big.iso storage1:data/isos/          upload into a directory
  rcp storage1:data/isos/big.iso ./        download
  rcp -r photos storage1:data/             upload a tree (symlinks, modes, mtimes kept;
                                           owners too when the receiver runs as root)
  rcp --json a b c storage1:data/in/       several files, JSON summary on stdout

EXIT CODES:
  0  success
  1  several different failures, or another error
  2  usage error
  3  cannot connect (no such host, connection refused, handshake failed)
  4  the server refused or failed (no such share or file, permission denied,
     outside the share, read-only share, no space on the server)
  5  local I/O error (a source that cannot be read, no space left locally)
  6  integrity failure (a chunk's hash did not match)
  7  authentication failed (no secret given, a wrong one, a secret file others
     can read, or a server that cannot prove it knows the secret)
  130, 143  interrupted by SIGINT, SIGTERM (unfinished files are not written)

RESUMING:
  Running the same copy again after it was interrupted (killed, disconnected, a
  server restart) resumes it: chunks that the destination's hidden partial file
  already holds are verified there and not sent again (--json: bytes_reused).
  Copying a file to a cluster again sends only the stripes whose bytes changed; the
  new version names the objects of the others (--json: stripes_sent,
  stripes_reused).";

/// Copy files and directory trees to and from a Ferry server (ferryd), like scp.
///
/// File data moves by one-sided RDMA READ (uploads: the server pulls from your mapped
/// file) and RDMA WRITE (downloads: the server pushes into your registered buffers),
/// emulated over TCP where no RDMA device exists. Every 1 MiB chunk is verified
/// against its hash (BLAKE3, or SHA-256 with --hash sha256), and a file appears under
/// its final name only when complete.
#[derive(Parser, Debug)]
#[command(
    name = "rcp",
    override_usage = "rcp [OPTIONS] SRC... DST",
    version,
    after_help = AFTER_HELP
)]
struct Args {
    /// Sources, then the destination.
    #[arg(required = true, num_args = 2.., value_name = "PATH")]
    operands: Vec<String>,

    /// Copy directories recursively.
    #[arg(short, long)]
    recursive: bool,

    /// Keep hard links inside the copied trees, as `rsync -H` does: the further names
    /// of a file are made hard links to its first on the receiving side, not copies.
    #[arg(short = 'H', long)]
    hard_links: bool,

    /// Copy extended attributes (user.*; trusted.* and security.* where the receiving
    /// side runs as root), as `rsync -X` does: set on each copied file, directory and
    /// symlink itself. Needs a server with the xattr capability; not with --cluster.
    #[arg(short = 'X', long)]
    xattrs: bool,

    /// Files over one chunk (1 MiB) in flight at once, largest first; batches of
    /// small files and files of up to one chunk run 8 x N (at most 256) at once beside
    /// them.
    #[arg(short, long, default_value_t = 4, value_name = "N", value_parser = clap::value_parser!(u16).range(1..=256))]
    jobs: u16,

    /// Print one JSON summary object on stdout at the end (no progress bar).
    #[arg(long)]
    json: bool,

    /// No progress bar and no summary line (errors are still printed).
    #[arg(short, long)]
    quiet: bool,

    /// Transport: `auto` uses RDMA where this machine has an RDMA device and the server
    /// serves it, else TCP; `rdma` fails rather than fall back; `tcp` never tries RDMA.
    /// The one used is shown on a terminal (and in `--json`). RDMA needs the server's
    /// RDMA-capable address, not 127.0.0.1.
    #[arg(
        long,
        value_name = "auto|rdma|tcp",
        default_value = "auto",
        env = "FERRY_TRANSPORT"
    )]
    transport: TransportChoice,

    /// File holding the share's secret (mode 0600 or stricter). Without it,
    /// $FERRY_SECRET is used if set.
    #[arg(long, value_name = "FILE", env = "FERRY_SECRET_FILE")]
    secret_file: Option<PathBuf>,

    /// Chunk-hash algorithm of the data this copy writes, and the only one offered:
    /// `blake3` (the default where the server has it: several GB/s per core) or
    /// `sha256` (for sites that require it; several times the CPU). Whatever is
    /// chosen, files are verified with the hashes recorded when they were written, in
    /// their own algorithm. Shown in `--json` as `hash`.
    #[arg(long, value_name = "blake3|sha256", env = "FERRY_HASH")]
    hash: Option<HashAlgorithm>,

    /// Encryption of the session (control messages and every byte of file data):
    /// `preferred` encrypts whenever the server supports it (AES-256-GCM, or
    /// ChaCha20-Poly1305 without AES instructions); `required` refuses a server that
    /// does not (an older one, or a middlebox stripping the offer); `off` asks for
    /// none (a share that requires it then refuses the copy). Shown on the
    /// connection line and in `--json` as `encryption`.
    #[arg(
        long,
        value_name = "preferred|required|off",
        default_value = "preferred",
        env = "FERRY_ENCRYPTION"
    )]
    encryption: Encryption,

    /// In an encrypted session, new keys for what rcp sends after this many bytes under
    /// one key (K, M, G, T suffixes; or after an hour) [default: 64G].
    #[arg(long, value_name = "SIZE", env = "FERRY_REKEY_AFTER", value_parser = |s: &str| ferry_common::units::parse_size(s).ok_or(format!("not a size: '{s}'")))]
    rekey_after: Option<u64>,

    /// Replicas of each stripe for files uploaded to a cluster share (default: the
    /// share's setting).
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u8).range(1..=8))]
    replicas: Option<u8>,

    /// etcd's TLS and user settings, for cluster:// operands.
    #[command(flatten)]
    etcd: ferry_cluster::EtcdArgs,

    /// More log output on stderr (repeat for more). RUST_LOG overrides.
    #[arg(short, long, action = clap::ArgAction::Count)]
    verbose: u8,
}

enum Direction {
    Upload(Vec<PathBuf>, Remote),
    Download(Vec<Remote>, PathBuf),
}

fn plan(args: &Args) -> Result<Direction, ClientError> {
    let parsed = args
        .operands
        .iter()
        .map(|a| location::parse(a, ferry_common::DEFAULT_PORT))
        .collect::<Result<Vec<_>, _>>()?;
    let (dest, sources) = parsed.split_last().expect("clap requires two operands");
    match dest {
        Location::Remote(dst) => {
            let locals = sources
                .iter()
                .map(|s| match s {
                    Location::Local(p) => Ok(p.clone()),
                    Location::Remote(r) => Err(ClientError::Usage(format!(
                        "{}: copying between two servers is not supported",
                        r.display()
                    ))),
                })
                .collect::<Result<Vec<_>, _>>()?;
            Ok(Direction::Upload(locals, dst.clone()))
        }
        Location::Local(dst) => {
            let remotes = sources
                .iter()
                .map(|s| match s {
                    Location::Remote(r) => Ok(r.clone()),
                    Location::Local(p) => Err(ClientError::Usage(format!(
                        "{}: one side must be remote (HOST:SHARE/PATH); use cp for local copies",
                        p.display()
                    ))),
                })
                .collect::<Result<Vec<_>, _>>()?;
            if let Some(other) = remotes.iter().find(|r| r.addr() != remotes[0].addr()) {
                return Err(ClientError::Usage(format!(
                    "{}: all remote sources must be on the same server",
                    other.display()
                )));
            }
            Ok(Direction::Download(remotes, dst.clone()))
        }
    }
}

fn main() -> ExitCode {
    raise_fd_limit();
    // Files it makes on a share whose owners are the clients' are its user's.
    ferry_client::posix::set_process_caller(ferry_client::posix::process_caller());
    // `rcp backup ...` is a command of its own (a source that is literally named
    // `backup` is given as `./backup`).
    if std::env::args_os().nth(1).is_some_and(|a| a == "backup") {
        let args = match cli::backup::parse(std::env::args_os().skip(1)) {
            Ok(a) => a,
            Err(e) if e.use_stderr() => {
                let _ = e.print();
                return ExitCode::from(exit::USAGE);
            }
            Err(e) => e.exit(),
        };
        init_logging(0);
        // Backups map their sources too (see below).
        let _ = ferry_common::transport::mem::exit_on_sigbus(
            b"rcp: a source file shrank while it was being read (SIGBUS); the backup was abandoned and no snapshot was published (run it again)\n",
            exit::LOCAL.into(),
        );
        return run_until_interrupted(
            cli::backup::run(args),
            "rcp: interrupted; no snapshot was published (run the backup again to continue)",
        );
    }
    let args = match Args::try_parse() {
        Ok(a) => a,
        Err(e) if e.use_stderr() => {
            // Bad arguments: scripts that asked for --json still get their one line.
            let _ = e.print();
            if std::env::args().any(|a| a == "--json") {
                let report = Report {
                    errors: vec![copy::ItemError {
                        path: String::new(),
                        error: ClientError::Usage(e.kind().to_string()),
                    }],
                    ..Report::default()
                };
                print_json("", None, &report, 0.0, exit::USAGE);
            }
            return ExitCode::from(exit::USAGE);
        }
        // --help and --version.
        Err(e) => e.exit(),
    };
    init_logging(args.verbose);
    // Uploads map their sources: a source truncated by another process mid-copy raises
    // SIGBUS. Say so and exit with the local-error code rather than die silently.
    let _ = ferry_common::transport::mem::exit_on_sigbus(
        b"rcp: a source file shrank while it was being read (SIGBUS); the copy was abandoned and nothing was written under its final name\n",
        exit::LOCAL.into(),
    );
    run_until_interrupted(
        run(args),
        "rcp: interrupted; unfinished files were not written (run the same copy again to resume them)",
    )
}

/// Runs `work` on a multi-threaded runtime until it ends or SIGINT/SIGTERM arrives
/// (then prints `on_interrupt` and exits 128 + signal). Dropping the runtime drops
/// every unfinished transfer: a download's scratch file is removed, its resumable
/// partial kept for the next run (the server keeps an upload's partial, and a backup's
/// partial snapshot, when the connection closes).
fn run_until_interrupted(
    work: impl std::future::Future<Output = u8>,
    on_interrupt: &str,
) -> ExitCode {
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            eprintln!("rcp: cannot start the runtime: {e}");
            return ExitCode::from(exit::OTHER);
        }
    };
    let code = runtime.block_on(async {
        tokio::select! {
            code = work => code,
            code = interrupted() => {
                eprintln!("{on_interrupt}");
                code
            }
        }
    });
    drop(runtime);
    ExitCode::from(code)
}

/// Resolves on SIGINT or SIGTERM with the conventional exit code (128 + signal).
async fn interrupted() -> u8 {
    use tokio::signal::unix::{signal, SignalKind};
    let (Ok(mut int), Ok(mut term)) = (
        signal(SignalKind::interrupt()),
        signal(SignalKind::terminate()),
    ) else {
        return std::future::pending().await;
    };
    tokio::select! {
        _ = int.recv() => 130,
        _ = term.recv() => 143,
    }
}

fn init_logging(verbose: u8) {
    let default = match verbose {
        0 => "warn",
        1 => "info",
        _ => "debug",
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

/// Raises the soft limit on open files to the hard limit, as ferryd does: a tree copy
/// holds the hidden files of up to `--jobs` batches of small files open at once (256
/// each) until their group flush, more than the usual soft limit of 1024.
fn raise_fd_limit() {
    use nix::sys::resource::{getrlimit, setrlimit, Resource};
    if let Ok((soft, hard)) = getrlimit(Resource::RLIMIT_NOFILE) {
        if soft < hard {
            let _ = setrlimit(Resource::RLIMIT_NOFILE, hard, hard);
        }
    }
}

async fn run(args: Args) -> u8 {
    let started = Instant::now();
    if args.operands.iter().any(|o| o.starts_with("cluster://")) {
        return run_cluster(args, started).await;
    }
    let direction = match plan(&args) {
        Ok(d) => d,
        Err(e) => return fail_early(&args, "", e, started),
    };
    let server = match &direction {
        Direction::Upload(_, r) => r.clone(),
        Direction::Download(rs, _) => rs[0].clone(),
    };
    let client = match connect_server(&args, &server).await {
        Ok(c) => c,
        Err(e) => return fail_early(&args, direction_name(&direction), e, started),
    };
    let mut link = Link::of(&client);
    if matches!(direction, Direction::Upload(..)) {
        // What the destination share records this upload's data in (its own setting
        // may differ from the session's preference). A share that does not exist is
        // reported by the copy.
        if let Ok(a) = client.share_hash(&server.share).await {
            link.hash = Some(a.name());
        }
    }
    let show = !args.quiet && !args.json && std::io::stderr().is_terminal();
    if show || args.verbose > 0 {
        let host = if server.host.contains(':') {
            format!("[{}]", server.host)
        } else {
            server.host.clone()
        };
        eprintln!("rcp: connected to {host}:{} over {link}", server.port);
    }
    let bar = progress_bar(show);
    let progress: Arc<dyn Progress> = Arc::new(Bar(bar.clone()));
    let opts = CopyOptions {
        recursive: args.recursive,
        jobs: args.jobs.into(),
        hard_links: args.hard_links,
        xattrs: args.xattrs,
    };
    let report = match &direction {
        Direction::Upload(srcs, dst) => copy::upload(&client, srcs, dst, &opts, progress).await,
        Direction::Download(srcs, dst) => copy::download(&client, srcs, dst, &opts, progress).await,
    };
    bar.finish_and_clear();
    client.close();
    let seconds = started.elapsed().as_secs_f64();
    print_errors(&report);
    if !args.quiet {
        for path in &report.skipped {
            eprintln!("rcp: {path}: skipped (not a regular file, directory or symlink)");
        }
    }
    let code = exit_code(&report);
    // What the files moved in, where any did: an upload resumed from a journal keeps
    // its algorithm, and a download gets each file's record.
    let used = client.hashes_used();
    match used[..] {
        [] => {}
        [one] => link.hash = Some(one.name()),
        _ => link.hash = Some("mixed"),
    }
    link.hashes = used.iter().map(|a| a.name()).collect();
    if args.json {
        print_json(
            direction_name(&direction),
            Some(&link),
            &report,
            seconds,
            code,
        );
    } else if show {
        let resumed = match report.bytes_reused {
            0 => String::new(),
            n => format!(", {} of it resumed", indicatif::BinaryBytes(n)),
        };
        print_summary(&report, &resumed, seconds);
    }
    code
}

/// A session to the server of `server` for `args`, its secret already proved, so a
/// wrong one fails before any work. A share that does not exist is reported by the
/// copy, item by item.
async fn connect_server(args: &Args, server: &Remote) -> Result<Client, ClientError> {
    let credentials = Credentials::from_file_or_env(args.secret_file.as_deref())?
        .with_hash(args.hash)
        .with_encryption(args.encryption)
        .with_rekey_after(args.rekey_after);
    let c = Client::connect_with(&server.host, server.port, args.transport, credentials).await?;
    match c.authenticate(&server.share).await {
        Err(e) if e.remote_kind() != Some(ferry_common::msg::ErrorKind::NoSuchShare) => Err(e),
        _ => Ok(c),
    }
}

/// One line per failed item of `report`, except that a lost connection is said once.
fn print_errors(report: &Report) {
    let mut lost = 0;
    for e in &report.errors {
        if matches!(e.error, ClientError::Disconnected(_)) {
            lost += 1;
            if lost > 1 {
                continue;
            }
        }
        eprintln!("rcp: {}", describe(&e.path, &e.error));
    }
    if lost > 1 {
        eprintln!(
            "rcp: {} more items not copied: connection to the server lost",
            lost - 1
        );
    }
}

/// The terminal's last line of a copy: what moved (`resumed` says how much of it was
/// resumed, if any), how long it took and how fast.
fn print_summary(report: &Report, resumed: &str, seconds: f64) {
    eprintln!(
        "rcp: {} files, {} dirs, {} symlinks, {}{resumed} in {:.2} s ({}/s)",
        report.files,
        report.dirs,
        report.symlinks,
        indicatif::BinaryBytes(report.bytes),
        seconds,
        indicatif::BinaryBytes((report.bytes as f64 / seconds.max(1e-9)) as u64),
    );
}

/// Connects to the cluster whose etcd is at `etcd` (a `cluster://` operand's host),
/// with the etcd settings of `args` and the cluster configuration file.
async fn connect_cluster(
    args: &Args,
    etcd: &str,
    credentials: Credentials,
) -> Result<ferry_cluster::Cluster, ClientError> {
    let config = args.etcd.resolve(Some(vec![etcd.to_owned()]))?;
    ferry_cluster::Cluster::connect(&config, args.transport, credentials).await
}

/// `rcp` with a `cluster://` operand: the copy goes to or from a cluster share.
async fn run_cluster(args: Args, started: Instant) -> u8 {
    use ferry_cluster::copy as ccopy;
    let planned = plan_cluster(&args);
    let plan = match planned {
        Ok(p) => p,
        Err(e) => return fail_early(&args, "", e, started),
    };
    let (direction, etcd) = match &plan {
        ClusterPlan::Up(_, d) => ("upload", d.etcd.clone()),
        ClusterPlan::Down(s, _) => ("download", s[0].etcd.clone()),
    };
    let credentials = match Credentials::from_file_or_env(args.secret_file.as_deref()) {
        Ok(c) => c
            .with_hash(args.hash)
            .with_encryption(args.encryption)
            .with_rekey_after(args.rekey_after),
        Err(e) => return fail_early(&args, direction, e, started),
    };
    let cluster = match connect_cluster(&args, &etcd, credentials).await {
        Ok(c) => c,
        Err(e) => return fail_early(&args, direction, e, started),
    };
    let show = !args.quiet && !args.json && std::io::stderr().is_terminal();
    if show || args.verbose > 0 {
        eprintln!(
            "rcp: cluster at etcd {etcd}: {} storage nodes alive",
            cluster.usable_nodes().len()
        );
    }
    let bar = progress_bar(show);
    let progress: Arc<dyn Progress> = Arc::new(Bar(bar.clone()));
    let opts = CopyOptions {
        recursive: args.recursive,
        jobs: args.jobs.into(),
        hard_links: args.hard_links,
        xattrs: false,
    };
    let report = match &plan {
        ClusterPlan::Up(srcs, dst) => {
            ccopy::upload(&cluster, srcs, dst, &opts, args.replicas, progress).await
        }
        ClusterPlan::Down(srcs, dst) => ccopy::download(&cluster, srcs, dst, &opts, progress).await,
    };
    bar.finish_and_clear();
    let link = cluster.any_session().await.map(|c| Link::of(&c));
    cluster.close().await;
    let seconds = started.elapsed().as_secs_f64();
    for e in &report.errors {
        eprintln!("rcp: {}", describe(&e.path, &e.error));
    }
    let code = exit_code(&report);
    if args.json {
        print_json(direction, link.as_ref(), &report, seconds, code);
    } else if show {
        // Like rsync's "matched data": what a re-run found already there.
        let stripes = match (report.stripes_sent, report.stripes_reused) {
            (_, 0) => String::new(),
            (sent, reused) => format!(", {sent} stripes sent, {reused} reused"),
        };
        print_summary(&report, &stripes, seconds);
    }
    code
}

/// A copy to or from a cluster share.
enum ClusterPlan {
    Up(Vec<PathBuf>, ferry_cluster::copy::ClusterPath),
    Down(Vec<ferry_cluster::copy::ClusterPath>, PathBuf),
}

/// The cluster copy `args` ask for: local sources to a cluster, or sources in one
/// cluster to a local destination.
fn plan_cluster(args: &Args) -> Result<ClusterPlan, ClientError> {
    use ferry_cluster::copy as ccopy;
    if args.xattrs {
        let why = "-X: extended attributes are not carried to or from a cluster";
        return Err(ClientError::Usage(why.into()));
    }
    let (dest, sources) = args
        .operands
        .split_last()
        .expect("clap requires two operands");
    let cluster_of = |a: &str| ccopy::parse(a).transpose();
    match cluster_of(dest)? {
        Some(dst) => {
            let locals = sources
                .iter()
                .map(|s| match cluster_of(s)? {
                    None if location::parse(s, ferry_common::DEFAULT_PORT)
                        .is_ok_and(|l| matches!(l, Location::Local(_))) =>
                    {
                        Ok(PathBuf::from(s))
                    }
                    _ => Err(ClientError::Usage(format!(
                        "{s}: copying between servers or clusters is not supported"
                    ))),
                })
                .collect::<Result<Vec<_>, _>>()?;
            Ok(ClusterPlan::Up(locals, dst))
        }
        None => {
            let remotes = sources
                .iter()
                .map(|s| {
                    cluster_of(s)?.ok_or_else(|| {
                        ClientError::Usage(format!(
                            "{s}: every source must be in the same cluster (cluster://...)"
                        ))
                    })
                })
                .collect::<Result<Vec<_>, _>>()?;
            if let Some(o) = remotes.iter().find(|r| r.etcd != remotes[0].etcd) {
                return Err(ClientError::Usage(format!(
                    "{}: all sources must be in the same cluster",
                    o.display()
                )));
            }
            Ok(ClusterPlan::Down(remotes, PathBuf::from(dest)))
        }
    }
}

fn direction_name(d: &Direction) -> &'static str {
    match d {
        Direction::Upload(..) => "upload",
        Direction::Download(..) => "download",
    }
}

/// One line for an error, `ITEM: CAUSE`, without saying the path twice: server
/// messages start with the share-relative path they are about, which is dropped when
/// the item (`host:port:share/path`) already ends with it.
fn describe(item: &str, e: &ClientError) -> String {
    match e {
        ClientError::Remote(r) if r.kind == ferry_common::msg::ErrorKind::AuthRequired => format!(
            "{}: give the share's secret with --secret-file FILE or $FERRY_SECRET_FILE",
            r.message
        ),
        ClientError::Remote(r) => {
            let cause = match r.message.split_once(": ") {
                Some((head, rest)) if !item.is_empty() && item.ends_with(head) => rest,
                _ => &r.message,
            };
            if item.is_empty() {
                cause.to_string()
            } else {
                format!("{item}: {cause}")
            }
        }
        ClientError::Local { .. }
        | ClientError::SourceChanged { .. }
        | ClientError::Usage(_)
        | ClientError::Integrity { .. }
        | ClientError::Connect { .. }
        | ClientError::Handshake { .. }
        | ClientError::Secret(_)
        | ClientError::ServerNotAuthentic { .. } => e.to_string(),
        other => format!("{item}: {other}"),
    }
}

fn exit_code(report: &Report) -> u8 {
    exit::shared(report.errors.iter().map(|e| exit::of(&e.error)))
}

fn fail_early(args: &Args, direction: &str, e: ClientError, started: Instant) -> u8 {
    eprintln!("rcp: {}", describe("", &e));
    let code = exit::of(&e);
    if args.json {
        let report = Report {
            errors: vec![copy::ItemError {
                path: String::new(),
                error: e,
            }],
            ..Report::default()
        };
        print_json(
            direction,
            None,
            &report,
            started.elapsed().as_secs_f64(),
            code,
        );
    }
    code
}

/// The transport a copy ran on, for the terminal line and `--json`.
struct Link {
    kind: &'static str,
    device: Option<String>,
    /// The chunk-hash algorithm the files moved in (`mixed` if several), else the
    /// session's for new data.
    hash: Option<&'static str>,
    /// Every algorithm files moved in.
    hashes: Vec<&'static str>,
    /// The cipher suite protecting the session, if it is encrypted.
    encryption: Option<&'static str>,
}

impl Link {
    fn of(client: &Client) -> Link {
        Link {
            kind: client.transport().kind().as_str(),
            device: client.transport().device(),
            hash: client.negotiated().map(|n| n.hash.name()),
            hashes: Vec::new(),
            encryption: client.encryption().map(|s| s.name()),
        }
    }
}

impl std::fmt::Display for Link {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.device {
            Some(d) => write!(f, "{} ({d})", self.kind)?,
            None => f.write_str(self.kind)?,
        }
        match self.encryption {
            Some(suite) => write!(f, ", encrypted with {suite}"),
            None => f.write_str(", NOT encrypted"),
        }
    }
}

fn print_json(direction: &str, link: Option<&Link>, report: &Report, seconds: f64, code: u8) {
    let errors: Vec<_> = report
        .errors
        .iter()
        .map(|e| {
            serde_json::json!({
                "path": e.path,
                "kind": e.error.kind(),
                "message": e.error.to_string(),
            })
        })
        .collect();
    let summary = serde_json::json!({
        "ok": code == exit::OK,
        "exit_code": code,
        "transport": link.map(|l| l.kind),
        "device": link.and_then(|l| l.device.clone()),
        "hash": link.and_then(|l| l.hash),
        "hashes": link.map(|l| l.hashes.clone()).unwrap_or_default(),
        "encrypted": link.map(|l| l.encryption.is_some()),
        "encryption": link.and_then(|l| l.encryption),
        "direction": direction,
        "files": report.files,
        "dirs": report.dirs,
        "symlinks": report.symlinks,
        "hard_links": report.hard_links,
        "skipped": report.skipped,
        "bytes": report.bytes,
        "bytes_sent": report.bytes_sent,
        "bytes_reused": report.bytes_reused,
        "stripes_sent": report.stripes_sent,
        "stripes_reused": report.stripes_reused,
        "seconds": seconds,
        "bytes_per_sec": if seconds > 0.0 { report.bytes as f64 / seconds } else { 0.0 },
        "errors": errors,
    });
    println!("{summary}");
}
