//! `rcp backup SRC_DIR HOST[:PORT]:SHARE/PREFIX`: one snapshot to one target (the
//! first step of issue 5's command; see `docs/backup-plan.md` for what remains).

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Instant, SystemTime};

use clap::Parser;
use ferry_client::backup::{backup, BackupReport};
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
    override_usage = "rcp backup [OPTIONS] SRC_DIR HOST[:PORT]:SHARE/PREFIX"
)]
pub struct BackupArgs {
    /// The local directory to back up.
    #[arg(value_name = "SRC_DIR")]
    src: PathBuf,

    /// Where the snapshots go.
    #[arg(value_name = "HOST[:PORT]:SHARE/PREFIX")]
    dest: String,

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

/// Runs `rcp backup` and returns the exit code (the copy's exit code table).
pub async fn run(args: BackupArgs) -> u8 {
    let started = Instant::now();
    let result = snapshot(&args).await;
    let seconds = started.elapsed().as_secs_f64();
    let code = match &result {
        Ok(_) => exit::OK,
        Err(e) => e.exit_code(),
    };
    match &result {
        Ok(r) if !args.json => eprintln!(
            "rcp: snapshot {} ({} files: {} unchanged, {} changed, {} new, {} deleted; {} bytes sent, {} reused) in {seconds:.1} s",
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
        Err(e) => eprintln!("rcp: {}: {e}", args.dest),
    }
    if args.json {
        print_json(&args, &result, seconds, code);
    }
    code
}

async fn snapshot(args: &BackupArgs) -> Result<BackupReport, ClientError> {
    let remote = match location::parse(&args.dest, ferry_common::DEFAULT_PORT)? {
        Location::Remote(r) if !r.path.is_empty() => r,
        _ => {
            return Err(ClientError::Usage(format!(
                "{}: the destination must be HOST[:PORT]:SHARE/PREFIX",
                args.dest
            )))
        }
    };
    let credentials = Credentials::from_file_or_env(args.secret_file.as_deref())?;
    let client =
        Client::connect_with(&remote.host, remote.port, args.transport, credentials).await?;
    client.authenticate(&remote.share).await?;
    let progress: ProgressFn = Arc::new(|_| {});
    backup(
        &client,
        &args.src,
        &remote.share,
        &remote.path,
        SystemTime::now(),
        progress,
    )
    .await
}

fn print_json(
    args: &BackupArgs,
    result: &Result<BackupReport, ClientError>,
    seconds: f64,
    code: u8,
) {
    let target = match result {
        Ok(r) => serde_json::json!({
            "target": args.dest,
            "ok": true,
            "snapshot": r.snapshot,
            "previous": r.previous,
        }),
        Err(e) => serde_json::json!({
            "target": args.dest,
            "ok": false,
            "error": { "kind": e.kind(), "message": e.to_string() },
        }),
    };
    let r = result.as_ref().ok().cloned().unwrap_or_default();
    let summary = serde_json::json!({
        "ok": code == exit::OK,
        "exit_code": code,
        "files_scanned": r.files_scanned,
        "files_unchanged": r.files_unchanged,
        "files_changed": r.files_changed,
        "files_new": r.files_new,
        "files_deleted": r.files_deleted,
        "bytes_sent": r.bytes_sent,
        "bytes_reused": r.bytes_reused,
        "seconds": seconds,
        "targets": [target],
    });
    println!("{summary}");
}
