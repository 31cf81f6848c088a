//! `rcp backup --list`, and how snapshots and pruning are shown (lines on a terminal,
//! objects in `--json`).

use ferry_client::backup::admin::{self, PruneReport, SnapshotInfo};
use ferry_client::error::ClientError;
use ferry_cluster::{snapshots, EtcdArgs};

use super::exit;
use super::target;

/// `rcp backup --list TARGET` (a node's or a cluster's): one line per snapshot on
/// stdout, or with `json` one array; returns the exit code.
pub async fn list(
    target: &str,
    json: bool,
    connect: target::Connect,
    secret_file: Option<&std::path::Path>,
    etcd: &EtcdArgs,
) -> u8 {
    let listed = async {
        if target::is_cluster(target) {
            let (cluster, at) = target::open_cluster(target, etcd, connect, secret_file).await?;
            let r = snapshots::list(&cluster, &at.share, &at.path).await;
            cluster.close().await;
            return r;
        }
        let wanted = "the destination must be HOST[:PORT]:SHARE/PREFIX";
        let (client, share, prefix) = target::open(target, wanted, connect, secret_file).await?;
        admin::list(&client, &share, &prefix).await
    };
    match listed.await {
        Ok(snapshots) if json => {
            let all: Vec<_> = snapshots.iter().map(snapshot_json).collect();
            println!("{}", serde_json::Value::Array(all));
            exit::OK
        }
        Ok(snapshots) => {
            snapshots.iter().for_each(|s| println!("{}", line(s)));
            exit::OK
        }
        Err(e) => {
            eprintln!("rcp: {target}: {e}");
            exit::of(&e)
        }
    }
}

/// One line for `rcp backup --list`: name, partial mark, files, apparent and unique
/// size (human-readable).
fn line(s: &SnapshotInfo) -> String {
    let mark = if s.partial { "  (partial)" } else { "" };
    format!(
        "{}{mark}  {} files  {}  unique {}",
        s.name,
        s.usage.files,
        indicatif::HumanBytes(s.usage.bytes),
        indicatif::HumanBytes(s.usage.unique_bytes)
    )
}

/// The object `rcp backup --list --json` prints for `s`.
fn snapshot_json(s: &SnapshotInfo) -> serde_json::Value {
    serde_json::json!({
        "name": s.name,
        "path": s.path,
        "partial": s.partial,
        "files": s.usage.files,
        "dirs": s.usage.dirs,
        "bytes": s.usage.bytes,
        "unique_bytes": s.usage.unique_bytes,
    })
}

/// The `--json` object of an error about `path`.
pub fn error_json(path: &str, e: &ClientError) -> serde_json::Value {
    serde_json::json!({ "path": path, "kind": e.kind(), "message": e.to_string() })
}

/// `(pruned, prune_errors)` of `prune` as `rcp backup --json` reports them.
pub fn prune_json(prune: &PruneReport) -> (serde_json::Value, serde_json::Value) {
    let errors: Vec<_> = prune.errors.iter().map(|(p, e)| error_json(p, e)).collect();
    (
        serde_json::json!(prune.pruned),
        serde_json::Value::Array(errors),
    )
}
