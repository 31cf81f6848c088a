//! `rcp backup SRC_DIR TARGET [--to TARGET ...]`: one snapshot on each target (a
//! node's `HOST[:PORT]:SHARE/PREFIX` or a cluster's `cluster://ETCD/SHARE/PREFIX`),
//! the targets in parallel and independent of each other, reported alike (issue 5;
//! `docs/backup-plan.md` says what remains).

use std::ffi::OsString;
use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Instant, SystemTime};

use clap::{ArgMatches, CommandFactory, FromArgMatches, Parser};
use ferry_client::backup::admin::{self, PruneReport, Retention};
use ferry_client::backup::{backup_with, BackupOptions, BackupReport, DEFAULT_JOBS};
use ferry_client::error::ClientError;
use ferry_client::filter::{Filter, Rule, RuleKind};
use ferry_client::progress::Progress;
use ferry_cluster::{backup as cbackup, EtcdArgs};
use ferry_common::msg::HashAlgorithm;
use ferry_common::seal::Encryption;
use ferry_common::transport::TransportChoice;

use super::admin::prune_json;
use super::progress::{progress_bar, Bar};
use super::{exit, target, verify};

/// The end of `rcp backup --help`.
const AFTER_HELP: &str = "\
INCLUDE/EXCLUDE:
  --include and --exclude rules are tried in the order given, both flags together;
  the first rule whose GLOB matches an entry decides, and an entry no rule matches
  is backed up. A GLOB without '/' matches the entry's name at any depth; one with
  a '/' matches its path relative to SRC_DIR ('*' and '?' stop at '/', '**' does
  not); a trailing '/' matches directories only. An excluded directory is not
  descended into. Excluded files count neither as scanned nor as deleted.
    --exclude '*.tmp' --exclude 'cache/'       no *.tmp files, no directory 'cache'
    --include 'keep.log' --exclude '*.log'     of the *.log files, only keep.log

RETENTION:
  With --keep and/or --keep-days, a snapshot is removed only if it is outside every
  rule given (--keep 3 --keep-days 7: the 3 newest and all of the last 7 days stay).
  Pruning runs per target only after that target's new snapshot is published, never
  removes the new snapshot, and also removes the target's partial snapshots older
  than the new one (interrupted runs). A pruning failure is reported (--json:
  pruned, prune_errors) but does not change the exit code. A dry run prunes nothing.

EXIT CODES:
  As for a copy (see rcp --help), and
  8  several targets: some succeeded, some failed (see --json's targets)
  9  --verify found damaged files";

/// Back up a directory tree as a snapshot `PREFIX/<UTC timestamp>/` on a Ferry server
/// or a cluster share: files unchanged since the previous snapshot are hard-linked to
/// it on the server (in a cluster: name its layout), changed files send only their
/// changed chunks (in a cluster: the whole file), and the snapshot gets its name only
/// when every file in it verified.
#[derive(Parser, Debug)]
#[command(
    name = "rcp backup",
    override_usage = "rcp backup [OPTIONS] SRC_DIR TARGET [--to TARGET]...\n       rcp backup --list TARGET [--json]\n       rcp backup [--json] --verify TARGET[/SNAPSHOT]\n  TARGET: HOST[:PORT]:SHARE/PREFIX or cluster://ETCD_HOST[:PORT]/SHARE/PREFIX",
    after_help = AFTER_HELP
)]
pub struct BackupArgs {
    /// The local directory to back up.
    #[arg(value_name = "SRC_DIR", required_unless_present_any = ["list", "verify"])]
    src: Option<PathBuf>,

    /// Where the snapshots go: HOST[:PORT]:SHARE/PREFIX, or cluster://ETCD_HOST[:PORT]/SHARE/PREFIX.
    #[arg(value_name = "TARGET", required_unless_present_any = ["list", "verify"])]
    dest: Option<String>,

    /// List the snapshots of a target instead of backing up: one line each, oldest
    /// first (name, files, size, unique size: what removing it would free), partial
    /// snapshots of interrupted runs marked; with --json, one JSON array.
    #[arg(
        long,
        value_name = "TARGET",
        conflicts_with_all = ["src", "dest", "to", "keep", "keep_days", "verify", "dry_run"]
    )]
    list: Option<String>,

    /// Have the server re-read a snapshot (the newest under PREFIX unless one is named)
    /// and compare every file with the manifests it recorded (in a cluster: every node
    /// each copy of a stripe it holds, also against the manifest its layout names);
    /// damaged files are listed with their chunks (and stripe, node and object), and
    /// the exit code is 9 if there are any.
    #[arg(
        long,
        value_name = "TARGET[/SNAPSHOT]",
        conflicts_with_all = ["src", "dest", "to", "keep", "keep_days", "dry_run"]
    )]
    verify: Option<String>,

    /// Keep the N newest snapshots of each target (the new one included) and remove
    /// the older ones, unless --keep-days keeps them. At least 1.
    #[arg(long, value_name = "N", value_parser = at_least_one)]
    keep: Option<u64>,

    /// Keep the snapshots taken less than D days ago (by their names' UTC times) and
    /// remove the older ones, unless --keep keeps them. At least 1.
    #[arg(long, value_name = "D", value_parser = at_least_one)]
    keep_days: Option<u64>,

    /// Another target, backed up in parallel (repeatable). A target that fails does
    /// not stop the others; exit code 8 says some failed and some succeeded.
    #[arg(long = "to", value_name = "TARGET")]
    to: Vec<String>,

    /// Print one JSON summary object on stdout at the end (no progress bar).
    #[arg(long)]
    json: bool,

    /// No progress bar and no summary line (errors are still printed).
    #[arg(short, long)]
    quiet: bool,

    /// Plan only: write nothing on any target, and report what would be unchanged,
    /// changed, new and deleted, and the bytes that would be sent (changed files'
    /// chunks compared with their previous copies' manifests; to a cluster, every
    /// replica of every file not unchanged).
    #[arg(short = 'n', long)]
    dry_run: bool,

    /// Back up entries GLOB matches, even if a later --exclude matches them too (see
    /// INCLUDE/EXCLUDE below). Repeatable.
    #[arg(long, value_name = "GLOB", value_parser = valid_glob)]
    include: Vec<String>,

    /// Leave out entries that GLOB matches, unless an earlier --include matches them
    /// (see INCLUDE/EXCLUDE below). Repeatable.
    #[arg(long, value_name = "GLOB", value_parser = valid_glob)]
    exclude: Vec<String>,

    /// Small requests (links, small files, listings) in flight at once per target.
    #[arg(short, long, default_value_t = DEFAULT_JOBS as u16, value_name = "N", value_parser = clap::value_parser!(u16).range(1..=256))]
    jobs: u16,

    /// Transport (as for a copy).
    #[arg(
        long,
        value_name = "auto|rdma|tcp",
        default_value = "auto",
        env = "FERRY_TRANSPORT"
    )]
    transport: TransportChoice,

    /// File holding the share's secret (mode 0600 or stricter).
    #[arg(long, value_name = "FILE", env = "FERRY_SECRET_FILE")]
    secret_file: Option<PathBuf>,

    /// etcd's TLS and user settings, for a cluster:// target.
    #[command(flatten)]
    etcd: ferry_cluster::EtcdArgs,

    /// Encryption (as for a copy): `preferred`, `required` or `off`.
    #[arg(
        long,
        value_name = "preferred|required|off",
        default_value = "preferred",
        env = "FERRY_ENCRYPTION"
    )]
    encryption: Encryption,

    /// Chunk-hash algorithm of what this backup writes (as for a copy): `blake3`, the
    /// default where the server has it, or `sha256`. Snapshots written in either are
    /// verified, and serve as the base of the next, in their own.
    #[arg(long, value_name = "blake3|sha256", env = "FERRY_HASH")]
    hash: Option<HashAlgorithm>,

    /// The --include and --exclude rules in command-line order (set by [`parse`]).
    #[arg(skip)]
    rules: Vec<Rule>,
}

/// Parses `rcp backup`'s arguments (`argv` starts with `backup`), keeping the
/// command-line order of the `--include` and `--exclude` rules across both flags.
pub fn parse<I, T>(argv: I) -> Result<BackupArgs, clap::Error>
where
    I: IntoIterator<Item = T>,
    T: Into<OsString> + Clone,
{
    let matches = BackupArgs::command().try_get_matches_from(argv)?;
    let mut args = BackupArgs::from_arg_matches(&matches)?;
    args.rules = ordered_rules(&matches)?;
    Ok(args)
}

fn ordered_rules(matches: &ArgMatches) -> Result<Vec<Rule>, clap::Error> {
    let mut given: Vec<(usize, RuleKind, &String)> = Vec::new();
    for (id, kind) in [
        ("include", RuleKind::Include),
        ("exclude", RuleKind::Exclude),
    ] {
        if let (Some(at), Some(globs)) = (matches.indices_of(id), matches.get_many::<String>(id)) {
            given.extend(at.zip(globs).map(|(i, g)| (i, kind, g)));
        }
    }
    given.sort_by_key(|(i, _, _)| *i);
    given
        .into_iter()
        .map(|(_, kind, glob)| {
            Rule::new(kind, glob).map_err(|e| {
                clap::Error::raw(clap::error::ErrorKind::ValueValidation, format!("{e}\n"))
            })
        })
        .collect()
}

fn valid_glob(glob: &str) -> Result<String, String> {
    Rule::new(RuleKind::Exclude, glob)
        .map(|_| glob.to_string())
        .map_err(|e| e.to_string())
}

/// Runs `rcp backup` and returns the exit code: the copy's table, plus
/// [`exit::SOME_TARGETS_FAILED`] when targets disagree.
pub async fn run(args: BackupArgs) -> u8 {
    let secret_file = args.secret_file.as_deref();
    let connect = target::Connect {
        transport: args.transport,
        hash: args.hash,
        encryption: args.encryption,
    };
    // Listing and verifying write nothing: they accept every hash.
    let reading = target::Connect {
        hash: None,
        ..connect
    };
    if let Some(target) = &args.list {
        return super::admin::list(target, args.json, reading, secret_file, &args.etcd).await;
    }
    if let Some(target) = &args.verify {
        return verify::run(target, args.json, reading, secret_file, &args.etcd).await;
    }
    let (Some(src), Some(dest)) = (args.src.clone(), args.dest.clone()) else {
        eprintln!("rcp: backup needs SRC_DIR and TARGET");
        return exit::USAGE;
    };
    let started = Instant::now();
    let targets: Vec<String> = std::iter::once(dest)
        .chain(args.to.iter().cloned())
        .collect();
    // One bar for all targets: each adds its total to the bar's.
    let show = !args.quiet && !args.json && std::io::stderr().is_terminal();
    let bar = progress_bar(show);
    let results = back_up_all(&args, &src, &targets, Arc::new(Bar(bar.clone()))).await;
    bar.finish_and_clear();
    let seconds = started.elapsed().as_secs_f64();
    let codes: Vec<u8> = results
        .iter()
        .map(|r| r.as_ref().map_or_else(exit::of, |_| exit::OK))
        .collect();
    let code = if codes.iter().all(|&c| c == codes[0]) {
        codes[0]
    } else if codes.contains(&exit::OK) {
        exit::SOME_TARGETS_FAILED
    } else {
        exit::OTHER
    };
    for (dest, result) in targets.iter().zip(&results) {
        print_result(dest, result, &args);
    }
    if args.json {
        print_json(&targets, &results, seconds, code, args.dry_run);
    }
    code
}

/// What one target's backup gave: its report and its pruning's, or why it failed.
type TargetResult = Result<(BackupReport, PruneReport), ClientError>;

/// Backs up `src` to every one of `targets` at once, each independent of the others;
/// returns their results in the order of `targets`.
async fn back_up_all(
    args: &BackupArgs,
    src: &Path,
    targets: &[String],
    progress: Arc<dyn Progress>,
) -> Vec<TargetResult> {
    let retention = Retention {
        keep: args.keep.map(|n| usize::try_from(n).unwrap_or(usize::MAX)),
        keep_days: args.keep_days,
    };
    // One timestamp for every target, so their snapshots share a name.
    let now = SystemTime::now();
    let opts = BackupOptions {
        filter: Filter::new(args.rules.clone()),
        dry_run: args.dry_run,
        jobs: args.jobs.into(),
    };
    let mut tasks = tokio::task::JoinSet::new();
    for (i, dest) in targets.iter().enumerate() {
        let (dest, src) = (dest.clone(), src.to_path_buf());
        let connect = target::Connect {
            transport: args.transport,
            hash: args.hash,
            encryption: args.encryption,
        };
        let (transport, secret_file) = (connect, args.secret_file.clone());
        let (opts, progress) = ((opts.clone(), retention), progress.clone());
        let etcd = args.etcd.clone();
        tasks.spawn(async move {
            let secret_file = secret_file.as_deref();
            let to = (dest.as_str(), transport, secret_file, &etcd);
            let r = snapshot(to, &src, now, &opts, progress);
            (i, r.await)
        });
    }
    let mut results: Vec<Option<TargetResult>> = targets.iter().map(|_| None).collect();
    while let Some(joined) = tasks.join_next().await {
        match joined {
            Ok((i, r)) => results[i] = Some(r),
            Err(e) => tracing::error!("a backup task failed: {e}"),
        }
    }
    results
        .into_iter()
        .map(|r| r.unwrap_or_else(|| Err(ClientError::Usage("the backup task failed".into()))))
        .collect()
}

/// The lines on stderr for the backup to `dest`: its summary and what pruning did
/// (not with `--json` or `--quiet`), and pruning failures and the error (always).
fn print_result(dest: &str, result: &TargetResult, args: &BackupArgs) {
    match result {
        Ok((r, prune)) if !args.json && !args.quiet => {
            eprintln!(
                "rcp: {dest}: {}snapshot {} ({} files: {} unchanged, {} changed, {} new, {} deleted; {} bytes {}sent, {} reused)",
                if r.dry_run { "dry run, nothing written: would make " } else { "" },
                r.snapshot,
                r.files_scanned,
                r.files_unchanged,
                r.files_changed,
                r.files_new,
                r.files_deleted,
                r.bytes_sent,
                if r.dry_run { "would be " } else { "" },
                r.bytes_reused
            );
            prune
                .pruned
                .iter()
                .for_each(|p| eprintln!("rcp: {dest}: removed {p}"));
            print_prune_errors(dest, prune);
        }
        // Pruning failures are printed even with --json or --quiet: they need
        // someone's attention although the backup succeeded.
        Ok((_, prune)) => print_prune_errors(dest, prune),
        Err(e) => eprintln!("rcp: {dest}: {e}"),
    }
}

fn print_prune_errors(dest: &str, prune: &PruneReport) {
    for (p, e) in &prune.errors {
        eprintln!("rcp: {dest}: cannot prune {p}: {e}");
    }
}

/// Where one target is and how to reach it: (target, transport, secret file, etcd's
/// settings for a cluster target).
type To<'a> = (&'a str, target::Connect, Option<&'a Path>, &'a EtcdArgs);

/// Backs up `src` to `dest`, then, unless it was a dry run, prunes `dest` (see
/// [`admin::after_publish`], or for a `cluster://` target
/// [`ferry_cluster::backup`], which prunes too).
async fn snapshot(
    (dest, transport, secret_file, etcd): To<'_>,
    src: &Path,
    now: SystemTime,
    (opts, retention): &(BackupOptions, Retention),
    progress: Arc<dyn Progress>,
) -> Result<(BackupReport, PruneReport), ClientError> {
    if target::is_cluster(dest) {
        let (cluster, at) = target::open_cluster(dest, etcd, transport, secret_file).await?;
        let r = cbackup::backup(&cluster, src, &at, now, opts, *retention, progress).await;
        cluster.close().await;
        return r;
    }
    let wanted = "the destination must be HOST[:PORT]:SHARE/PREFIX";
    let (client, share, prefix) = target::open(dest, wanted, transport, secret_file).await?;
    let result = async {
        let report = backup_with(&client, src, &share, &prefix, now, opts, progress).await?;
        let prune = match opts.dry_run {
            true => PruneReport::default(),
            false => {
                let name = report.snapshot.rsplit('/').next().unwrap_or_default();
                admin::after_publish(&client, &share, &prefix, name, retention, now).await
            }
        };
        Ok((report, prune))
    }
    .await;
    client.close();
    result
}

/// A `--keep` or `--keep-days` count: 0 would remove every snapshot but the new one.
fn at_least_one(arg: &str) -> Result<u64, String> {
    match arg.parse::<u64>() {
        Ok(0) => Err("must be at least 1 (0 would remove every snapshot but the new one)".into()),
        Ok(n) => Ok(n),
        Err(e) => Err(e.to_string()),
    }
}

fn print_json(targets: &[String], results: &[TargetResult], seconds: f64, code: u8, dry_run: bool) {
    let per_target: Vec<_> = targets
        .iter()
        .zip(results)
        .map(|(dest, result)| match result {
            Ok((r, prune)) => serde_json::json!({
                "target": dest,
                "ok": true,
                "exit_code": exit::OK,
                "snapshot": r.snapshot,
                "previous": r.previous,
                "files_scanned": r.files_scanned,
                "files_unchanged": r.files_unchanged,
                "files_changed": r.files_changed,
                "files_new": r.files_new,
                "files_deleted": r.files_deleted,
                "bytes_sent": r.bytes_sent,
                "bytes_reused": r.bytes_reused,
                "hashes": r.hashes.iter().map(|a| a.name()).collect::<Vec<_>>(),
                "seconds": r.duration.as_secs_f64(),
                "pruned": prune_json(prune).0,
                "prune_errors": prune_json(prune).1,
            }),
            Err(e) => serde_json::json!({
                "target": dest,
                "ok": false,
                "exit_code": exit::of(e),
                "error": { "kind": e.kind(), "message": e.to_string() },
            }),
        })
        .collect();
    // The top-level counts are those of the first target that succeeded (every target
    // scans the same source); the byte counts add up over the targets.
    let first = results
        .iter()
        .find_map(|r| r.as_ref().ok())
        .map(|(r, _)| r.clone())
        .unwrap_or_default();
    let ok = results
        .iter()
        .filter_map(|r| r.as_ref().ok().map(|(r, _)| r));
    let prunes = results
        .iter()
        .filter_map(|r| r.as_ref().ok().map(|(_, p)| p));
    let pruned: Vec<_> = prunes.clone().flat_map(|p| &p.pruned).collect();
    let prune_errors: Vec<_> = prunes
        .flat_map(|p| prune_json(p).1.as_array().cloned().unwrap_or_default())
        .collect();
    let summary = serde_json::json!({
        "ok": code == exit::OK,
        "exit_code": code,
        "dry_run": dry_run,
        "files_scanned": first.files_scanned,
        "files_unchanged": first.files_unchanged,
        "files_changed": first.files_changed,
        "files_new": first.files_new,
        "files_deleted": first.files_deleted,
        "bytes_sent": ok.clone().map(|r| r.bytes_sent).sum::<u64>(),
        "bytes_reused": ok.map(|r| r.bytes_reused).sum::<u64>(),
        "seconds": seconds,
        "pruned": pruned,
        "prune_errors": prune_errors,
        "targets": per_target,
    });
    println!("{summary}");
}
