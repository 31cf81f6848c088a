//! `ferry-mount`: mount a Ferry share read-only through FUSE.

use std::io::{BufRead, BufReader, IsTerminal, Read, Write};
use std::os::fd::AsRawFd;
use std::os::unix::fs::DirBuilderExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use clap::Parser;
use ferry_client::location::{self, Location};
use ferry_client::Credentials;
use ferry_cluster::health::{Health, HealthPolicy};
use ferry_common::msg::{Attr, ErrorKind, FileKind, HashAlgorithm};
use ferry_common::transport::{TransportChoice, TransportKind};
use ferry_common::DEFAULT_PORT;
use ferry_fuse::cluster::stripes::Nodes;
use ferry_fuse::cluster::ClusterFs;
use ferry_fuse::fs::FerryFs;
use ferry_fuse::mount::Unmounter;
use ferry_fuse::options::{Access, MountOptions, WriteMode};
use ferry_fuse::remote::Remote;
use fuser::{Config, Filesystem, MountOption, Session, SessionACL};

/// Exit codes, stable for scripts.
mod exit {
    pub const OTHER: u8 = 1;
    pub const USAGE: u8 = 2;
    pub const CONNECT: u8 = 3;
    pub const MOUNT: u8 = 4;
    pub const AUTH: u8 = 5;
}

/// Set by a background mount in the child it starts: say "ready" on stdout once
/// mounted.
const NOTIFY_ENV: &str = "FERRY_MOUNT_NOTIFY";

#[derive(Parser, Debug)]
#[command(
    name = "ferry-mount",
    version,
    about = "Mount a Ferry share: file reads are one-sided RDMA READs of the server's \
             memory and written data is pulled by the server with one-sided READs, every \
             chunk checked against its hash",
    after_help = "\
Examples:
  ferry-mount storage1:data /mnt/data                 detach once mounted
  ferry-mount -f -o attr_timeout=5 storage1:7447:data/projects /mnt/p
  ferry-mount --transport rdma 10.0.0.2:data /mnt/data
  ferry-mount cluster://etcd1:2379/data /mnt/data     a cluster share
Unmount with `umount MOUNTPOINT`, `fusermount3 -u MOUNTPOINT`, or SIGINT/SIGTERM to
ferry-mount.

Mount options (-o, comma-separated):
  ro                     read-only: writes give EROFS
  rw                     read-write or fail (default: read-write when the server
                         supports writes and the share is not exported :ro, else
                         read-only with a warning)
  writeback=MIB          written data held before the server has pulled it, in
                         registered buffers (default 64); a writer waits beyond it
  encryption=POLICY      preferred (default), required or off, as --encryption
  sync_close             close(2) returns once the data is durable on the server (as
                         NFS's COMMIT); by default close makes it visible everywhere
                         and fsync makes it durable, as on a local file system
  allow_other            let every user use the mount (allow_root: root as well)
  default_permissions    let the kernel check permission bits
  attr_timeout=SECS      trust attributes this long (default 1)
  entry_timeout=SECS     trust name lookups this long (default 1)
  negative_timeout=SECS  remember missing names this long (default 1)
  cache_size=MIB         memory for verified chunks (default 256)
  chunk_size=BYTES       verification unit, a power of two 4K..1M (default: per file,
                         16K, larger for files over 2 GiB so the manifest stays <= 4 MiB)
  readahead=CHUNKS       chunks fetched ahead of a sequential reader (default: 2 MiB worth)
  max_readahead=KIB      the kernel's readahead for the mount (default 1024; as root)
  timeout=SECS           bound on each server round trip and read (default 20)
  threads=N              threads taking requests from the kernel (default 4)
  fsname=NAME            source name shown by mount(8)
  secret_file=PATH       the share's secret (as --secret-file)

Cluster shares (cluster://ETCD_HOST[:PORT]/SHARE[/PATH], etcd's port defaults to
2379) mount read-write (-o ro: read-only). Names and attributes come from etcd; each
stripe is read from the first live replica whose chunks verify against the layout's
manifest, passing over nodes that fail. Writes are close-to-open and whole-file: a
file opened for writing is staged in /var/tmp/ferry-mount-PID/ (an existing one is
fetched first unless truncated) and close or fsync stores it striped and replicated,
then publishes it with one etcd compare-and-swap: others see the old file or the new
one, never a mix, and a new file only once closed; a failed store gives EIO and
publishes nothing. mkdir, rmdir, unlink, symlink, chmod, touch and rename of files
are one etcd transaction each; renaming a directory gives EXDEV (mv copies), hard
links and device nodes EPERM (writeback, sync_close and chunk_size do not apply).
The secret is the cluster's (the store share's), given the same way. etcd over TLS
and with a user: --etcd-ca, --etcd-cert, --etcd-key, --etcd-user and
--etcd-password-file, or the cluster configuration file (--cluster-config FILE,
$FERRY_CLUSTER_CONFIG, else /etc/ferry/cluster.toml when it exists).

Secrets: the share's secret comes from --secret-file (or -o secret_file=PATH, or
$FERRY_SECRET_FILE), a file of mode 0600, or from $FERRY_SECRET.

Exit status: 0 mounted (and, in the foreground, cleanly unmounted), 1 other error,
2 usage error, 3 cannot reach the server, 4 cannot mount, 5 authentication failed."
)]
struct Args {
    /// The share: HOST[:PORT]:SHARE[/SUBDIR] (PORT defaults to 7447), or a cluster
    /// share: cluster://ETCD_HOST[:PORT]/SHARE[/PATH].
    source: String,
    /// An existing directory to mount on.
    mountpoint: PathBuf,
    /// Stay in the foreground (default: detach once the mount is ready).
    #[arg(short = 'f', long)]
    foreground: bool,
    /// Mount options, comma-separated (see below).
    #[arg(short = 'o', value_name = "OPTS")]
    options: Vec<String>,
    /// Transport: auto (RDMA when a device and the server allow, else TCP), rdma, tcp.
    #[arg(long, env = "FERRY_TRANSPORT", default_value = "auto")]
    transport: TransportChoice,
    /// File holding the share's secret (mode 0600 or stricter); else $FERRY_SECRET.
    #[arg(long, value_name = "FILE", env = "FERRY_SECRET_FILE")]
    secret_file: Option<PathBuf>,
    /// The only chunk-hash algorithm offered: blake3 or sha256 (default: both, blake3
    /// preferred). Every chunk read is verified with the hashes the server recorded
    /// when the file was written, in their own algorithm where the mount offers it.
    #[arg(long, value_name = "blake3|sha256", env = "FERRY_HASH")]
    hash: Option<HashAlgorithm>,
    /// Encryption of the session: preferred (whenever the server supports it),
    /// required (refuse a server that does not) or off.
    #[arg(
        long,
        value_name = "preferred|required|off",
        default_value = "preferred",
        env = "FERRY_ENCRYPTION"
    )]
    encryption: ferry_common::seal::Encryption,
    /// etcd's TLS and user settings, for a cluster:// share.
    #[command(flatten)]
    etcd: ferry_cluster::EtcdArgs,
    /// More logging on stderr (-v: debug, -vv: trace).
    #[arg(short, long, action = clap::ArgAction::Count)]
    verbose: u8,
}

fn main() -> ExitCode {
    let args = Args::parse();
    let notify = std::env::var_os(NOTIFY_ENV).is_some();
    // A background mount is as quiet as mount(8) unless something goes wrong.
    init_logging(args.verbose, notify && args.verbose == 0);
    match run(args, notify) {
        Ok(()) => ExitCode::SUCCESS,
        Err((code, e)) => {
            eprintln!("ferry-mount: {e:#}");
            ExitCode::from(code)
        }
    }
}

fn init_logging(verbose: u8, quiet: bool) {
    let default = match verbose {
        0 if quiet => "warn",
        0 => "info,fuser=warn",
        1 => "debug,fuser=info",
        _ => "trace",
    };
    let filter = tracing_subscriber::EnvFilter::try_from_env("FERRY_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_target(false)
        .with_ansi(std::io::stderr().is_terminal())
        .with_writer(std::io::stderr)
        .init();
}

type Failure = (u8, anyhow::Error);

fn fail(code: u8) -> impl FnOnce(anyhow::Error) -> Failure {
    move |e| (code, e)
}

/// The mount, from the command line to the end of the FUSE session.
fn run(args: Args, notify: bool) -> Result<(), Failure> {
    if args.source.starts_with("cluster://") {
        return run_cluster(args, notify);
    }
    let opts = parse_options(&args.options)?;
    let remote = parse_source(&args.source)?;
    check_mountpoint(&args.mountpoint)?;
    if !args.foreground && !notify {
        return detach();
    }

    let rt = runtime()?;
    let credentials = credentials(&args, &opts)?;
    let link = Arc::new(Remote::new(
        remote.host.clone(),
        remote.port,
        args.transport,
        credentials,
        opts.timeout,
        if opts.write == WriteMode::ReadOnly {
            0
        } else {
            opts.writeback_bytes
        },
    ));
    let (via, writable) = rt.block_on(check_share(&link, &remote, &opts))?;

    let at = MountAt::new(&opts, &remote.display(), writable, &args.mountpoint, notify)?;
    let fs = FerryFs::new(
        rt.handle().clone(),
        link,
        remote.share.clone(),
        remote.path.clone(),
        opts,
        writable,
    )
    .with_mountpoint(at.absolute.clone());
    let notifier = fs.notifier_slot();
    let mounted = format!(
        "mounted {} on {} over {via}, {}",
        remote.display(),
        args.mountpoint.display(),
        if writable { "read-write" } else { "read-only" }
    );
    mount_and_serve(fs, rt, at, &mounted, |n| {
        let _ = notifier.set(n);
    })
}

/// Where and how [`mount_and_serve`] mounts.
struct MountAt<'a> {
    mountpoint: &'a Path,
    /// `mountpoint` resolved before mounting: afterwards, resolving the path would
    /// call into the mount, whose session is not running yet.
    absolute: PathBuf,
    fsname: String,
    config: Config,
    readahead_kib: u32,
    /// A background parent waits for "ready" on stdout.
    notify: bool,
}

impl<'a> MountAt<'a> {
    /// From the options; `source` names the mount unless `fsname=` does.
    fn new(
        opts: &MountOptions,
        source: &str,
        writable: bool,
        mountpoint: &'a Path,
        notify: bool,
    ) -> Result<MountAt<'a>, Failure> {
        let absolute = mountpoint
            .canonicalize()
            .with_context(|| format!("{}", mountpoint.display()))
            .map_err(fail(exit::MOUNT))?;
        let fsname = opts
            .fsname
            .clone()
            .unwrap_or_else(|| format!("ferry:{source}"));
        let config = fuse_config(opts, &fsname, writable);
        Ok(MountAt {
            mountpoint,
            absolute,
            fsname,
            config,
            readahead_kib: opts.max_readahead_kib,
            notify,
        })
    }
}

/// Mounts `fs`, raises the kernel's readahead, unmounts on SIGINT/SIGTERM, logs
/// `mounted`, tells a waiting parent, and serves until the mount goes.
/// `with_notifier` gets the session's notifier before the first request is served.
fn mount_and_serve<FS: Filesystem>(
    fs: FS,
    rt: tokio::runtime::Runtime,
    at: MountAt<'_>,
    mounted: &str,
    with_notifier: impl FnOnce(fuser::Notifier),
) -> Result<(), Failure> {
    let (session, unmounter) = ferry_fuse::mount::mount(fs, at.mountpoint, &at.fsname, &at.config)
        .map_err(|e| {
            (
                exit::MOUNT,
                anyhow::anyhow!("cannot mount on {}: {e}", at.mountpoint.display()),
            )
        })?;
    with_notifier(session.notifier());
    if let Err(e) = ferry_fuse::mount::set_readahead(&at.absolute, at.readahead_kib) {
        tracing::debug!("kernel readahead left at its default: {e}");
    }
    let unmounting = unmount_on_signal(&rt, at.mountpoint.to_path_buf(), unmounter);
    tracing::info!("{mounted}");
    if at.notify {
        println!("ready");
        let _ = std::io::stdout().flush();
        quiet_std_streams();
    }
    serve(session, rt, &unmounting, at.mountpoint)
}

/// The mount of a cluster share (read-write unless `-o ro`), from the command line to
/// the end of the FUSE session.
fn run_cluster(args: Args, notify: bool) -> Result<(), Failure> {
    let opts = parse_options(&args.options)?;
    let source = match ferry_cluster::copy::parse(&args.source) {
        Some(Ok(p)) => p,
        Some(Err(e)) => return Err((exit::USAGE, anyhow::anyhow!("{e}"))),
        None => {
            return Err((
                exit::USAGE,
                anyhow::anyhow!("'{}' is not a cluster:// share", args.source),
            ))
        }
    };
    let writable = opts.write != WriteMode::ReadOnly;
    let defaults = MountOptions::default();
    for (set, name) in [
        (
            opts.writeback_bytes != defaults.writeback_bytes,
            "writeback",
        ),
        (opts.sync_close, "sync_close"),
        (
            opts.chunk_bytes.is_some(),
            "chunk_size (the layout fixes it)",
        ),
    ] {
        if set {
            tracing::warn!("-o {name} does not apply to a cluster mount; ignored");
        }
    }
    check_mountpoint(&args.mountpoint)?;
    if !args.foreground && !notify {
        return detach();
    }

    let rt = runtime()?;
    let credentials = credentials(&args, &opts)?;
    let etcd = args
        .etcd
        .resolve(Some(vec![source.etcd.clone()]))
        .map_err(|e| (exit::USAGE, anyhow::anyhow!("{e}")))?;
    let nodes = rt.block_on(check_cluster(
        &source,
        &etcd,
        &opts,
        args.transport,
        credentials.clone(),
    ))?;
    let writer = if writable {
        Some(rt.block_on(cluster_writer(
            &source,
            nodes.set().clone(),
            &opts,
            args.transport,
            credentials,
        ))?)
    } else {
        None
    };

    let at = MountAt::new(&opts, &source.display(), writable, &args.mountpoint, notify)?;
    let fs = ClusterFs::new(
        rt.handle().clone(),
        nodes,
        source.share.clone(),
        source.path.clone(),
        opts,
        writer,
    );
    let mounted = format!(
        "mounted {} on {}, {}",
        source.display(),
        args.mountpoint.display(),
        if writable { "read-write" } else { "read-only" }
    );
    mount_and_serve(fs, rt, at, &mounted, |_| {})
}

/// What a writable cluster mount writes with: a cluster client over the mount's node
/// set (its one etcd connection and failure policy, shared with the readers), the
/// share's settings, and a private staging directory `/var/tmp/ferry-mount-PID`.
async fn cluster_writer(
    source: &ferry_cluster::copy::ClusterPath,
    set: Arc<ferry_cluster::NodeSet>,
    opts: &MountOptions,
    transport: TransportChoice,
    credentials: Credentials,
) -> Result<ferry_fuse::cluster::write::Writer, Failure> {
    let cluster = tokio::time::timeout(
        opts.timeout,
        ferry_cluster::Cluster::over(set, transport, credentials),
    )
    .await
    .map_err(|_| {
        (
            exit::CONNECT,
            anyhow::anyhow!("etcd {}: no answer within {:?}", source.etcd, opts.timeout),
        )
    })?
    .map_err(|e| (exit::CONNECT, anyhow::anyhow!("{e}")))?;
    let config = cluster
        .meta()
        .share(&source.share)
        .await
        .map_err(|e| (exit::MOUNT, anyhow::anyhow!("{}: {e}", source.display())))?;
    let dir = PathBuf::from(format!("/var/tmp/ferry-mount-{}", std::process::id()));
    let made = std::fs::DirBuilder::new()
        .mode(0o700)
        .create(&dir)
        .or_else(|e| match e.kind() {
            // Left by an earlier process of this pid: nothing in it is needed.
            std::io::ErrorKind::AlreadyExists => std::fs::remove_dir_all(&dir)
                .and_then(|()| std::fs::DirBuilder::new().mode(0o700).create(&dir)),
            _ => Err(e),
        });
    made.map_err(|e| {
        (
            exit::MOUNT,
            anyhow::anyhow!("staging directory {}: {e}", dir.display()),
        )
    })?;
    Ok(ferry_fuse::cluster::write::Writer {
        cluster,
        config,
        dir,
    })
}

/// Before mounting a cluster share: etcd answers, the share exists, the mounted path
/// is a directory, and a live node accepts the secret (none live: a warning, the
/// namespace still mounts). Returns the nodes, with that node's connection open.
async fn check_cluster(
    source: &ferry_cluster::copy::ClusterPath,
    etcd_config: &ferry_cluster::EtcdConfig,
    opts: &MountOptions,
    transport: TransportChoice,
    credentials: Credentials,
) -> Result<Arc<Nodes>, Failure> {
    let etcd = &source.etcd;
    let meta = tokio::time::timeout(opts.timeout, ferry_cluster::Meta::connect(etcd_config))
        .await
        .map_err(|_| {
            (
                exit::CONNECT,
                anyhow::anyhow!("etcd {etcd}: no answer within {:?}", opts.timeout),
            )
        })?
        .map_err(|e| {
            // etcd refusing the user or its password is an authentication failure.
            let code = if e.kind() == "auth_failed" {
                exit::AUTH
            } else {
                exit::CONNECT
            };
            (code, anyhow::anyhow!("{e}"))
        })?;
    let mount_err = |e: ferry_client::ClientError| {
        let code = if e.remote_kind().is_some() {
            exit::MOUNT
        } else {
            exit::CONNECT
        };
        (code, anyhow::anyhow!("{}: {e}", source.display()))
    };
    meta.share(&source.share).await.map_err(mount_err)?;
    let root = meta
        .existing(&source.share, &source.path)
        .await
        .map_err(mount_err)?;
    if root.entry.kind != ferry_cluster::model::EntryKind::Dir {
        return Err((
            exit::MOUNT,
            anyhow::anyhow!("{}: not a directory", source.display()),
        ));
    }
    let set = ferry_cluster::NodeSet::new(meta, Arc::new(Health::new(HealthPolicy::from_env())));
    let nodes = Nodes::new(
        set,
        transport,
        credentials,
        opts.timeout,
        opts.cache_bytes,
        opts.readahead_chunks,
    );
    let live = nodes
        .refresh()
        .await
        .map_err(|e| (exit::CONNECT, anyhow::anyhow!("{}", e.message)))?;
    match nodes.probe().await {
        Ok(Some((node, via))) => tracing::info!(
            "cluster at etcd {etcd}: {} storage nodes alive; {node} answers over {via}",
            live.len()
        ),
        Ok(None) => tracing::warn!(
            "cluster at etcd {etcd}: no storage node answers ({} registered); file reads \
             fail with EIO until one does",
            live.len()
        ),
        Err(e) => {
            let (code, message) = auth_failure(e);
            return Err((code, anyhow::anyhow!("{}: {message}", source.display())));
        }
    }
    Ok(nodes)
}

/// The secret (`-o secret_file=` over `--secret-file`, else the environment), the
/// hash algorithm and the encryption policy (`-o encryption=` over `--encryption`).
fn credentials(args: &Args, opts: &MountOptions) -> Result<Credentials, Failure> {
    let secret_file = opts.secret_file.clone().or(args.secret_file.clone());
    Ok(Credentials::from_file_or_env(secret_file.as_deref())
        .map_err(|e| (exit::AUTH, anyhow::anyhow!("{e}")))?
        .with_hash(args.hash)
        .with_encryption(opts.encryption.unwrap_or(args.encryption)))
}

/// The `-o` options, each argument a comma-separated list.
fn parse_options(options: &[String]) -> Result<MountOptions, Failure> {
    let mut opts = MountOptions::default();
    for o in options {
        opts.parse_into(o)
            .map_err(|e| (exit::USAGE, anyhow::anyhow!("{e}")))?;
    }
    Ok(opts)
}

/// The share named by `HOST[:PORT]:SHARE[/SUBDIR]`.
fn parse_source(source: &str) -> Result<location::Remote, Failure> {
    match location::parse(source, DEFAULT_PORT) {
        Ok(Location::Remote(r)) => Ok(r),
        Ok(Location::Local(_)) | Err(_) => Err((
            exit::USAGE,
            anyhow::anyhow!("'{source}' is not a share: expected HOST[:PORT]:SHARE[/SUBDIR]"),
        )),
    }
}

/// The mountpoint must be an existing directory.
fn check_mountpoint(mountpoint: &Path) -> Result<(), Failure> {
    match std::fs::metadata(mountpoint) {
        Ok(m) if m.is_dir() => Ok(()),
        Ok(_) => Err((
            exit::MOUNT,
            anyhow::anyhow!("{}: not a directory", mountpoint.display()),
        )),
        Err(e) => Err((
            exit::MOUNT,
            anyhow::anyhow!("{}: {e}", mountpoint.display()),
        )),
    }
}

/// The runtime the filesystem's tasks run on.
fn runtime() -> Result<tokio::runtime::Runtime, Failure> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(std::thread::available_parallelism().map_or(2, |n| n.get().clamp(2, 8)))
        .thread_name("ferry-mount")
        .enable_all()
        .build()
        .context("cannot start the runtime")
        .map_err(fail(exit::OTHER))
}

/// Connects, proves the secret and stats the share's root before mounting, so a
/// server that cannot be reached, a wrong or missing secret, or a root that is not a
/// directory fails the mount itself. Returns the transport in use, for the log.
/// Connects, checks the share's root is a directory and decides whether the mount
/// writes; returns how it is connected and that.
async fn check_share(
    link: &Remote,
    remote: &location::Remote,
    opts: &MountOptions,
) -> Result<(String, bool), Failure> {
    let timeout = opts.timeout;
    let (transport, device, root_attr) =
        connect_and_stat(link, remote, timeout)
            .await
            .map_err(|(code, message)| {
                let whom = if code == exit::MOUNT {
                    remote.display()
                } else {
                    remote.addr()
                };
                (code, anyhow::anyhow!("{whom}: {message}"))
            })?;
    if root_attr.kind != FileKind::Dir {
        return Err((
            exit::MOUNT,
            anyhow::anyhow!("{}: not a directory", remote.display()),
        ));
    }
    let via = match device {
        Some(d) => format!("{} ({d})", transport.as_str()),
        None => transport.as_str().to_string(),
    };
    let writable = match opts.write {
        WriteMode::ReadOnly => false,
        wanted => {
            let why_not = why_read_only(link, remote, timeout).await?;
            match (why_not, wanted) {
                (None, _) => true,
                (Some(why), WriteMode::ReadWrite) => {
                    return Err((
                        exit::MOUNT,
                        anyhow::anyhow!("{}: cannot mount read-write: {why}", remote.display()),
                    ))
                }
                (Some(why), _) => {
                    tracing::warn!("mounting {} read-only: {why}", remote.display());
                    false
                }
            }
        }
    };
    Ok((via, writable))
}

/// Why the share cannot be mounted read-write, if it cannot.
async fn why_read_only(
    link: &Remote,
    remote: &location::Remote,
    timeout: Duration,
) -> Result<Option<String>, Failure> {
    let conn = link.conn().await.map_err(|e| {
        (
            exit::CONNECT,
            anyhow::anyhow!("{}: {}", remote.addr(), e.message),
        )
    })?;
    if !conn.client.can_write() {
        return Ok(Some(format!(
            "the server at {} does not support writes (an older ferryd)",
            remote.addr()
        )));
    }
    let writable = tokio::time::timeout(timeout, conn.client.share_access(&remote.share))
        .await
        .map_err(|_| {
            (
                exit::CONNECT,
                anyhow::anyhow!("{}: no answer within {timeout:?}", remote.addr()),
            )
        })?
        .map_err(|e| (exit::MOUNT, anyhow::anyhow!("{}: {e}", remote.display())))?;
    Ok((!writable).then(|| "the share is exported read-only".to_string()))
}

/// The transport, its device and the root's attributes; on failure the exit code and
/// what went wrong.
async fn connect_and_stat(
    link: &Remote,
    remote: &location::Remote,
    timeout: Duration,
) -> Result<(TransportKind, Option<String>, Attr), (u8, String)> {
    let conn = link.conn().await.map_err(|e| (exit::CONNECT, e.message))?;
    conn.client
        .authenticate(&remote.share)
        .await
        .map_err(auth_failure)?;
    let root = tokio::time::timeout(timeout, conn.client.stat(&remote.share, &remote.path, true))
        .await
        .map_err(|_| (exit::CONNECT, format!("no answer within {timeout:?}")))?
        .map_err(auth_failure)?;
    let t = conn.client.transport();
    Ok((t.kind(), t.device(), root))
}

/// The exit code and message for a refused authentication or stat of the root.
fn auth_failure(e: ferry_client::ClientError) -> (u8, String) {
    let code = match e.remote_kind() {
        Some(ErrorKind::AuthRequired) => {
            return (
                exit::AUTH,
                format!("{e}: give it with --secret-file FILE or $FERRY_SECRET_FILE"),
            )
        }
        Some(ErrorKind::AuthFailed) | None => exit::AUTH,
        Some(_) => exit::MOUNT,
    };
    (code, e.to_string())
}

/// The FUSE session's settings: read-only, no devices or setuid, who may use it.
fn fuse_config(opts: &MountOptions, fsname: &str, writable: bool) -> Config {
    let mut config = Config::default();
    config.mount_options = vec![
        if writable {
            MountOption::RW
        } else {
            MountOption::RO
        },
        MountOption::NoDev,
        MountOption::NoSuid,
        MountOption::FSName(fsname.to_string()),
        MountOption::Subtype("ferry".into()),
    ];
    if opts.default_permissions {
        config.mount_options.push(MountOption::DefaultPermissions);
    }
    config.acl = match opts.access {
        Access::Owner => SessionACL::Owner,
        Access::OwnerAndRoot => SessionACL::RootAndOwner,
        Access::All => SessionACL::All,
    };
    config.n_threads = Some(opts.threads);
    config.clone_fd = opts.threads > 1;
    config
}

/// Unmounts on SIGINT/SIGTERM; the session loop then ends by itself. The flag returned
/// is set once a signal asked for the unmount.
fn unmount_on_signal(
    rt: &tokio::runtime::Runtime,
    mountpoint: PathBuf,
    mut unmounter: Unmounter,
) -> Arc<AtomicBool> {
    let unmounting = Arc::new(AtomicBool::new(false));
    let unmount_asked = unmounting.clone();
    rt.spawn(async move {
        use tokio::signal::unix::{signal, SignalKind};
        let (Ok(mut term), Ok(mut int)) = (
            signal(SignalKind::terminate()),
            signal(SignalKind::interrupt()),
        ) else {
            tracing::error!("cannot install signal handlers");
            return;
        };
        tokio::select! {
            _ = term.recv() => {}
            _ = int.recv() => {}
        }
        tracing::info!("signal received: unmounting {}", mountpoint.display());
        unmount_asked.store(true, Ordering::SeqCst);
        if let Err(e) = unmounter.unmount() {
            tracing::error!("cannot unmount {}: {e}", mountpoint.display());
        }
    });
    unmounting
}

/// Runs the FUSE session until the filesystem is unmounted, then stops the runtime.
fn serve<FS: Filesystem>(
    session: Session<FS>,
    rt: tokio::runtime::Runtime,
    unmounting: &AtomicBool,
    mountpoint: &Path,
) -> Result<(), Failure> {
    let result = session.run();
    rt.shutdown_timeout(Duration::from_secs(1));
    match result {
        Ok(()) => {
            tracing::info!("unmounted {}", mountpoint.display());
            Ok(())
        }
        // The kernel may end a connection we are unmounting with ECONNABORTED rather
        // than ENODEV (a busy mount falls back to a lazy unmount): still a clean end.
        Err(e)
            if unmounting.load(Ordering::SeqCst)
                && e.raw_os_error() == Some(nix::libc::ECONNABORTED) =>
        {
            tracing::info!("unmounted {}", mountpoint.display());
            Ok(())
        }
        Err(e) => Err((exit::OTHER, anyhow::anyhow!("FUSE session ended: {e}"))),
    }
}

/// Background mode: runs the mount in a child process of its own process group, shows
/// its messages until it is mounted, and exits with its status if it fails first.
fn detach() -> Result<(), Failure> {
    let exe = std::env::current_exe()
        .context("cannot find my own executable")
        .map_err(fail(exit::OTHER))?;
    let mut child = Command::new(exe)
        .args(std::env::args_os().skip(1))
        .env(NOTIFY_ENV, "1")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .process_group(0)
        .spawn()
        .context("cannot start the background mount")
        .map_err(fail(exit::OTHER))?;
    let stderr = child.stderr.take().expect("piped");
    // Forward the child's messages while it starts; once it says "ready" it stops
    // writing to this pipe.
    let forward = std::thread::spawn(move || {
        let mut err = std::io::stderr();
        let mut buf = [0u8; 4096];
        let mut r = stderr;
        while let Ok(n) = r.read(&mut buf) {
            if n == 0 {
                break;
            }
            let _ = err.write_all(&buf[..n]);
        }
    });
    let mut line = String::new();
    let stdout = child.stdout.take().expect("piped");
    let _ = BufReader::new(stdout).read_line(&mut line);
    if line.trim() == "ready" {
        // The child has closed its copies of the pipes; the forwarder sees the end.
        let _ = forward.join();
        return Ok(());
    }
    let status = child
        .wait()
        .context("background mount")
        .map_err(fail(exit::OTHER))?;
    let _ = forward.join();
    let code = status
        .code()
        .and_then(|c| u8::try_from(c).ok())
        .unwrap_or(exit::OTHER);
    // The child already printed why.
    std::process::exit(i32::from(code.max(1)));
}

/// Points stdout and stderr at /dev/null (a detached mount has no terminal; the parent
/// that read them has exited).
fn quiet_std_streams() {
    if let Ok(null) = std::fs::OpenOptions::new().write(true).open("/dev/null") {
        let _ = nix::unistd::dup2(null.as_raw_fd(), 1);
        let _ = nix::unistd::dup2(null.as_raw_fd(), 2);
    }
}
