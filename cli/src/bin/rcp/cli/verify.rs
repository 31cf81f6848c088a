//! `rcp backup --verify HOST[:PORT]:SHARE/PREFIX[/SNAPSHOT]`: connects, has the server
//! verify the snapshot ([`ferry_client::backup::verify`]), prints one line per
//! damaged, unverifiable or failed file and a summary on stderr (or, with `--json`,
//! one object on stdout), and says the exit code.

use std::path::Path;
use std::time::Instant;

use ferry_client::backup::verify::{resolve_snapshot, verify_snapshot, Damaged, VerifyOutcome};
use ferry_client::error::ClientError;
use ferry_cluster::{snapshots, EtcdArgs};
use ferry_common::msg::VerifyRecord;

use super::admin::error_json;
use super::exit;
use super::target;

/// Runs `rcp backup --verify TARGET` and returns the exit code.
pub async fn run(
    target: &str,
    json: bool,
    connect: target::Connect,
    secret_file: Option<&Path>,
    etcd: &EtcdArgs,
) -> u8 {
    let started = Instant::now();
    let outcome = match target::is_cluster(target) {
        true => verify_cluster(target, connect, secret_file, etcd).await,
        false => connect_and_verify(target, connect, secret_file).await,
    };
    let seconds = started.elapsed().as_secs_f64();
    let code = match &outcome {
        Ok(o) => exit_code(o),
        Err(e) => exit::of(e),
    };
    if json {
        println!("{}", to_json(target, &outcome, code, seconds));
        return code;
    }
    match &outcome {
        Ok(o) => print_outcome(target, o),
        Err(e) => eprintln!("rcp: {target}: {e}"),
    }
    code
}

/// The exit code of a verify: [`exit::DAMAGE_FOUND`] if any file is damaged; else the
/// errors' code if they share one (1 if not); else 0. Unverifiable files do not fail
/// it.
fn exit_code(o: &VerifyOutcome) -> u8 {
    if !o.damaged.is_empty() {
        return exit::DAMAGE_FOUND;
    }
    exit::shared(o.errors.iter().map(|(_, e)| exit::of(e)))
}

async fn connect_and_verify(
    target: &str,
    connect: target::Connect,
    secret_file: Option<&Path>,
) -> Result<VerifyOutcome, ClientError> {
    let wanted = "--verify takes HOST[:PORT]:SHARE/PREFIX[/SNAPSHOT]";
    let (client, share, path) = target::open(target, wanted, connect, secret_file).await?;
    let snapshot = resolve_snapshot(&client, &share, &path).await?;
    Ok(verify_snapshot(&client, &share, &snapshot).await)
}

/// `--verify` of a `cluster://ETCD/SHARE/PREFIX[/SNAPSHOT]` target: each node checks
/// the copies it holds ([`snapshots::verify`]).
async fn verify_cluster(
    target: &str,
    connect: target::Connect,
    secret_file: Option<&Path>,
    etcd: &EtcdArgs,
) -> Result<VerifyOutcome, ClientError> {
    let (cluster, at) = target::open_cluster(target, etcd, connect, secret_file).await?;
    let outcome = async {
        let snapshot = snapshots::resolve_snapshot(&cluster, &at.share, &at.path).await?;
        Ok(snapshots::verify(&cluster, &at.share, &snapshot).await)
    }
    .await;
    cluster.close().await;
    outcome
}

/// The lines on stderr for the verify of `target`.
fn print_outcome(target: &str, o: &VerifyOutcome) {
    for d in &o.damaged {
        eprintln!(
            "rcp: damaged: {}/{}: {}{}",
            o.snapshot,
            d.path,
            replica(d),
            damage(d)
        );
    }
    for path in &o.unverifiable {
        eprintln!(
            "rcp: unverifiable (no record on the server): {}/{path}",
            o.snapshot
        );
    }
    for (path, e) in &o.errors {
        eprintln!("rcp: {}/{path}: {e}", o.snapshot);
    }
    eprintln!(
        "rcp: {target}: snapshot {}: {} files ({} bytes): {} verified, {} damaged, {} without a record, {} errors",
        o.snapshot,
        o.files,
        o.bytes,
        o.verified,
        o.damaged.len(),
        o.unverifiable.len(),
        o.errors.len()
    );
}

/// `stripe I on node N (object P): ` for a damaged copy in a cluster; empty else.
fn replica(d: &Damaged) -> String {
    d.replica.as_ref().map_or_else(String::new, |r| {
        format!(
            "stripe {} on node {} (object {}): ",
            r.stripe, r.node, r.object
        )
    })
}

/// `chunks 1, 4 (and 2 more) of N bytes: REASON` for a damaged file (the reason
/// alone where no chunk differs: a cluster copy with other bytes than its layout's).
fn damage(d: &Damaged) -> String {
    if d.report.bad_chunks.is_empty() {
        return d.reason().to_owned();
    }
    let words: Vec<String> = d.report.bad_chunks.iter().map(u64::to_string).collect();
    let listed = d.report.bad_chunks.len() as u64;
    let more = if d.report.bad_count > listed {
        format!(" (and {} more)", d.report.bad_count - listed)
    } else {
        String::new()
    };
    format!(
        "chunks {}{more} of {} bytes: {}",
        words.join(", "),
        d.report.chunk_bytes,
        d.reason()
    )
}

/// The `--json` object of a verify.
fn to_json(
    target: &str,
    outcome: &Result<VerifyOutcome, ClientError>,
    code: u8,
    seconds: f64,
) -> serde_json::Value {
    match outcome {
        Ok(o) => serde_json::json!({
            "ok": code == exit::OK,
            "exit_code": code,
            "target": target,
            "snapshot": o.snapshot,
            "files": o.files,
            "bytes": o.bytes,
            "verified": o.verified,
            "damaged": o.damaged.iter().map(|d| serde_json::json!({
                "path": d.path,
                "reason": d.reason(),
                "record": record_name(d.report.record),
                "chunk_bytes": d.report.chunk_bytes,
                "bad_count": d.report.bad_count,
                "bad_chunks": d.report.bad_chunks,
                "node": d.replica.as_ref().map(|r| &r.node),
                "stripe": d.replica.as_ref().map(|r| r.stripe),
                "object": d.replica.as_ref().map(|r| &r.object),
            })).collect::<Vec<_>>(),
            "unverifiable": o.unverifiable,
            "errors": o.errors.iter().map(|(p, e)| error_json(p, e)).collect::<Vec<_>>(),
            "seconds": seconds,
        }),
        Err(e) => serde_json::json!({
            "ok": false,
            "exit_code": code,
            "target": target,
            "error": { "kind": e.kind(), "message": e.to_string() },
            "seconds": seconds,
        }),
    }
}

fn record_name(r: VerifyRecord) -> &'static str {
    match r {
        VerifyRecord::Missing => "missing",
        VerifyRecord::Current => "current",
        VerifyRecord::Stale { .. } => "stale",
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ferry_common::msg::{ErrorKind, RemoteError, VerifyReport};

    #[test]
    fn damage_wins_over_errors_and_missing_records_do_not_fail() {
        let mut o = VerifyOutcome {
            unverifiable: vec!["x".into()],
            ..VerifyOutcome::default()
        };
        assert_eq!(exit_code(&o), exit::OK);
        o.errors.push(("y".into(), ClientError::Usage("u".into())));
        assert_eq!(exit_code(&o), exit::USAGE);
        o.errors.push((
            "z".into(),
            ClientError::Remote(RemoteError {
                kind: ErrorKind::NotFound,
                message: "m".into(),
            }),
        ));
        assert_eq!(exit_code(&o), exit::OTHER);
        o.damaged.push(Damaged {
            path: "f".into(),
            report: VerifyReport {
                algorithm: ferry_common::msg::HashAlgorithm::Blake3,
                record: VerifyRecord::Current,
                size: 1,
                chunk_bytes: 1,
                chunks: 1,
                bad_count: 3,
                bad_chunks: vec![0],
            },
            replica: None,
        });
        assert_eq!(exit_code(&o), exit::DAMAGE_FOUND);
        assert!(damage(&o.damaged[0]).starts_with("chunks 0 (and 2 more) of 1 bytes: "));
    }
}
