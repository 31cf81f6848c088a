//! `rcp backup SRC_DIR HOST[:PORT]:SHARE/PREFIX [--to HOST2:SHARE/PREFIX ...]`: one
//! snapshot on each target, the targets in parallel and independent of each other
//! (issue 5; `docs/backup-plan.md` says what remains).

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Instant, SystemTime};

use clap::Parser;
use ferry_client::backup::{backup, BackupReport};
use ferry_client::backup_verify;
use ferry_client::error::{exit, ClientError};
use ferry_client::location::{self, Location};
use ferry_client::transfer::ProgressFn;
use ferry_client::{Client, Credentials};
use ferry_common::transport::TransportChoice;

/// Back up a directory tree as a snapshot `PREFIX/<UTC timestamp>/` on a Ferry server:
/// files unchanged since the previous snapshot are hard-linked to it on the server,
/// changed files send only their changed chunks, and the snapshot gets its name only
/// when every file in it verified.
#[derive(Parser, Debug)]
#[command(
    name = "rcp backup",
    override_usage = "rcp backup [OPTIONS] SRC_DIR HOST[:PORT]:SHARE/PREFIX [--to HOST[:PORT]:SHARE/PREFIX]...\n       rcp backup [--json] --verify HOST[:PORT]:SHARE/PREFIX[/SNAPSHOT]",
    after_help = "EXIT CODES:\n  As for a copy (see rcp --help), and\n  8  several targets: some succeeded, some failed (see --json's targets)\n  9  --verify found damaged files"
)]
pub struct BackupArgs {
    /// The local directory to back up.
    #[arg(value_name = "SRC_DIR", required_unless_present_any = ["verify"])]
    src: Option<PathBuf>,

    /// Where the snapshots go.
    #[arg(value_name = "HOST[:PORT]:SHARE/PREFIX", required_unless_present_any = ["verify"])]
    dest: Option<String>,

    /// Have the server re-read a snapshot (the newest under PREFIX unless one is named)
    /// and compare every file with the manifests it recorded; damaged files are listed
    /// with their chunks, and the exit code is 9 if there are any.
    #[arg(
        long,
        value_name = "HOST[:PORT]:SHARE/PREFIX[/SNAPSHOT]",
        conflicts_with_all = ["src", "dest", "to"]
    )]
    verify: Option<String>,

    /// Another target, backed up in parallel (repeatable). A target that fails does
    /// not stop the others; exit code 8 says some failed and some succeeded.
    #[arg(long = "to", value_name = "HOST[:PORT]:SHARE/PREFIX")]
    to: Vec<String>,

    /// Print one JSON summary object on stdout at the end.
    #[arg(long)]
    json: bool,

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
}

/// Runs `rcp backup` and returns the exit code: the copy's table, plus
/// [`exit::SOME_TARGETS_FAILED`] when targets disagree.
pub async fn run(args: BackupArgs) -> u8 {
    if let Some(target) = &args.verify {
        let secret_file = args.secret_file.as_deref();
        return backup_verify::run(target, args.json, args.transport, secret_file).await;
    }
    let (Some(src), Some(dest)) = (args.src.clone(), args.dest.clone()) else {
        eprintln!("rcp: backup needs SRC_DIR and HOST[:PORT]:SHARE/PREFIX");
        return exit::USAGE;
    };
    let started = Instant::now();
    // One timestamp for every target, so their snapshots share a name.
    let now = SystemTime::now();
    let targets: Vec<String> = std::iter::once(dest)
        .chain(args.to.iter().cloned())
        .collect();
    let mut tasks = tokio::task::JoinSet::new();
    for (i, dest) in targets.iter().enumerate() {
        let (dest, src) = (dest.clone(), src.clone());
        let (transport, secret_file) = (args.transport, args.secret_file.clone());
        tasks.spawn(async move {
            let r = snapshot(&dest, &src, transport, secret_file.as_deref(), now).await;
            (i, r)
        });
    }
    let mut results: Vec<Option<Result<BackupReport, ClientError>>> =
        targets.iter().map(|_| None).collect();
    while let Some(joined) = tasks.join_next().await {
        match joined {
            Ok((i, r)) => results[i] = Some(r),
            Err(e) => tracing::error!("a backup task failed: {e}"),
        }
    }
    let results: Vec<Result<BackupReport, ClientError>> = results
        .into_iter()
        .map(|r| r.unwrap_or_else(|| Err(ClientError::Usage("the backup task failed".into()))))
        .collect();
    let seconds = started.elapsed().as_secs_f64();
    let codes: Vec<u8> = results
        .iter()
        .map(|r| r.as_ref().map_or_else(ClientError::exit_code, |_| exit::OK))
        .collect();
    let code = if codes.iter().all(|&c| c == codes[0]) {
        codes[0]
    } else if codes.contains(&exit::OK) {
        exit::SOME_TARGETS_FAILED
    } else {
        exit::OTHER
    };
    for (dest, result) in targets.iter().zip(&results) {
        match result {
            Ok(r) if !args.json => eprintln!(
                "rcp: {dest}: snapshot {} ({} files: {} unchanged, {} changed, {} new, {} deleted; {} bytes sent, {} reused)",
                r.snapshot,
                r.files_scanned,
                r.files_unchanged,
                r.files_changed,
                r.files_new,
                r.files_deleted,
                r.bytes_sent,
                r.bytes_reused
            ),
            Ok(_) => {}
            Err(e) => eprintln!("rcp: {dest}: {e}"),
        }
    }
    if args.json {
        print_json(&targets, &results, seconds, code);
    }
    code
}

async fn snapshot(
    dest: &str,
    src: &std::path::Path,
    transport: TransportChoice,
    secret_file: Option<&std::path::Path>,
    now: SystemTime,
) -> Result<BackupReport, ClientError> {
    let remote = match location::parse(dest, ferry_common::DEFAULT_PORT)? {
        Location::Remote(r) if !r.path.is_empty() => r,
        _ => {
            return Err(ClientError::Usage(format!(
                "{dest}: the destination must be HOST[:PORT]:SHARE/PREFIX"
            )))
        }
    };
    let credentials = Credentials::from_file_or_env(secret_file)?;
    let client = Client::connect_with(&remote.host, remote.port, transport, credentials).await?;
    client.authenticate(&remote.share).await?;
    let progress: ProgressFn = Arc::new(|_| {});
    backup(&client, src, &remote.share, &remote.path, now, progress).await
}

fn print_json(
    targets: &[String],
    results: &[Result<BackupReport, ClientError>],
    seconds: f64,
    code: u8,
) {
    let per_target: Vec<_> = targets
        .iter()
        .zip(results)
        .map(|(dest, result)| match result {
            Ok(r) => serde_json::json!({
                "target": dest,
                "ok": true,
                "snapshot": r.snapshot,
                "previous": r.previous,
                "files_unchanged": r.files_unchanged,
                "files_changed": r.files_changed,
                "files_new": r.files_new,
                "files_deleted": r.files_deleted,
                "bytes_sent": r.bytes_sent,
                "bytes_reused": r.bytes_reused,
                "seconds": r.duration.as_secs_f64(),
            }),
            Err(e) => serde_json::json!({
                "target": dest,
                "ok": false,
                "error": { "kind": e.kind(), "message": e.to_string() },
            }),
        })
        .collect();
    // The top-level counts are those of the first target that succeeded (every target
    // scans the same source); the byte counts add up over the targets.
    let first = results
        .iter()
        .find_map(|r| r.as_ref().ok())
        .cloned()
        .unwrap_or_default();
    let ok = results.iter().filter_map(|r| r.as_ref().ok());
    let summary = serde_json::json!({
        "ok": code == exit::OK,
        "exit_code": code,
        "files_scanned": first.files_scanned,
        "files_unchanged": first.files_unchanged,
        "files_changed": first.files_changed,
        "files_new": first.files_new,
        "files_deleted": first.files_deleted,
        "bytes_sent": ok.clone().map(|r| r.bytes_sent).sum::<u64>(),
        "bytes_reused": ok.map(|r| r.bytes_reused).sum::<u64>(),
        "seconds": seconds,
        "targets": per_target,
    });
    println!("{summary}");
}
