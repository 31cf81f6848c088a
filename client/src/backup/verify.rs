//! Verifying a snapshot (`rcp backup --verify`): the server re-reads every
//! regular file of a snapshot from its disk and compares it with the manifest it
//! recorded for that file ([`Client::verify`]); damaged files are reported with their
//! chunk indices.
//!
//! Outcomes per file (see [`VerifyRecord`]): verified (every chunk matches its record);
//! damaged (chunks differ: with the record still current, the bytes changed below the
//! filesystem; with a stale record, the file was modified after the backup); no record
//! (the server never recorded that file, e.g. one put into the share by hand, or one
//! modified within a second before its backup: unverifiable, not damage; the server
//! records it now, so the next verify checks it); or an error (the file could not be
//! verified at all).

use std::collections::BTreeMap;

use ferry_common::msg::{ErrorKind, FileKind, RemoteError, VerifyRecord, VerifyReport};

use crate::client::Client;
use crate::error::ClientError;
use crate::schedule::run_lanes;
use crate::walk::join;

use super::name::is_snapshot_name;

/// Files verified at once: each keeps the server's cores hashing and its disk reading.
pub const VERIFY_IN_FLIGHT: usize = 4;

/// A file whose bytes differ from its recorded manifest.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Damaged {
    /// Path inside the snapshot.
    pub path: String,
    /// What the server's answer was.
    pub report: VerifyReport,
    /// In a cluster snapshot: the copy of the file's stripe that is damaged.
    pub replica: Option<Replica>,
}

/// One copy of one stripe of a file in a cluster (`rcp backup --verify` of a
/// `cluster://` target), as checked by the node holding it.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct Replica {
    /// The node holding it.
    pub node: String,
    /// The stripe's index in the file.
    pub stripe: usize,
    /// The object's path in the node's store.
    pub object: String,
    /// True if the node's manifest of the object is not the one its layout names.
    pub other_bytes: bool,
}

impl Damaged {
    /// Why the file is damaged, in words.
    pub fn reason(&self) -> &'static str {
        if self.report.bad_count == 0 && self.replica.as_ref().is_some_and(|r| r.other_bytes) {
            return "the node's manifest of the object is not the one its layout names";
        }
        match self.report.record {
            VerifyRecord::Current => {
                "bytes differ from the backup although the file was not modified since (damaged on the server's storage)"
            }
            VerifyRecord::Stale {
                size_changed: true, ..
            } => "modified after the backup (size changed)",
            VerifyRecord::Stale {
                mtime_changed: true,
                ..
            } => "modified after the backup",
            VerifyRecord::Stale { .. } => {
                "changed after the backup with its mtime kept (its status change time moved)"
            }
            VerifyRecord::Missing => "no record",
        }
    }
}

/// What a verify of one snapshot found.
#[derive(Debug, Default)]
pub struct VerifyOutcome {
    /// Share-relative path of the snapshot verified.
    pub snapshot: String,
    /// Regular files in the snapshot.
    pub files: u64,
    /// Their bytes.
    pub bytes: u64,
    /// Files whose every chunk matched its record.
    pub verified: u64,
    /// Files whose bytes differ from their record, by path.
    pub damaged: Vec<Damaged>,
    /// Files the server holds no record of, by path inside the snapshot.
    pub unverifiable: Vec<String>,
    /// Files (or directories) that could not be verified, with why.
    pub errors: Vec<(String, ClientError)>,
}

/// Finds the snapshot `path` names in `share`: `path` itself if its last component is
/// a snapshot name, else the newest snapshot directly under `path` (a prefix).
pub async fn resolve_snapshot(
    client: &Client,
    share: &str,
    path: &str,
) -> Result<String, ClientError> {
    let last = path.rsplit('/').next().unwrap_or("");
    if is_snapshot_name(last) {
        return Ok(path.to_owned());
    }
    let newest = client
        .list_dir(share, path)
        .await?
        .into_iter()
        .filter(|e| e.attr.kind == FileKind::Dir && is_snapshot_name(&e.name))
        .map(|e| e.name)
        .max();
    match newest {
        Some(name) if path.is_empty() => Ok(name),
        Some(name) => Ok(format!("{path}/{name}")),
        None => Err(ClientError::Remote(RemoteError {
            kind: ErrorKind::NotFound,
            message: format!("{share}/{path}: no snapshot to verify"),
        })),
    }
}

/// Verifies every regular file under `snapshot` (share-relative), at most
/// [`VERIFY_IN_FLIGHT`] at once. Symlinks are not followed and not verified. A
/// directory that cannot be listed is an error of the outcome, not of the call.
pub async fn verify_snapshot(client: &Client, share: &str, snapshot: &str) -> VerifyOutcome {
    let mut out = VerifyOutcome {
        snapshot: snapshot.to_owned(),
        ..VerifyOutcome::default()
    };
    // (path inside the snapshot, size) of every regular file, in name order.
    let mut files: Vec<(String, u64)> = Vec::new();
    let mut dirs = vec![String::new()];
    while let Some(dir) = dirs.pop() {
        let full = join(snapshot, &dir);
        let entries = match client.list_dir(share, &full).await {
            Ok(e) => e,
            Err(e) => {
                out.errors.push((dir, e));
                continue;
            }
        };
        for e in entries {
            let rel = join(&dir, &e.name);
            match e.attr.kind {
                FileKind::Dir => dirs.push(rel),
                FileKind::File => files.push((rel, e.attr.size)),
                FileKind::Symlink | FileKind::Other | FileKind::Node { .. } => {}
            }
        }
    }
    files.sort();
    out.files = files.len() as u64;
    out.bytes = files.iter().map(|(_, size)| size).sum();
    let rels = files.into_iter().map(|(rel, _)| rel).collect();
    // Each file's failure is its own: the tasks never fail, only a panic stops them.
    let verified = run_lanes(vec![(rels, VERIFY_IN_FLIGHT)], |rel: String| {
        let (client, share, full) = (client.clone(), share.to_owned(), join(snapshot, &rel));
        async move { Ok((rel, client.verify(&share, &full).await)) }
    })
    .await;
    let results: BTreeMap<_, _> = match verified {
        Ok(r) => r.into_iter().collect(),
        Err(e) => {
            out.errors.push((String::new(), e));
            BTreeMap::new()
        }
    };
    for (path, result) in results {
        match result {
            Ok(r) if r.record == VerifyRecord::Missing => out.unverifiable.push(path),
            Ok(r) if r.bad_count > 0 => out.damaged.push(Damaged {
                path,
                report: r,
                replica: None,
            }),
            Ok(_) => out.verified += 1,
            Err(e) => out.errors.push((path, e)),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn damaged(record: VerifyRecord) -> Damaged {
        Damaged {
            path: "f".into(),
            report: VerifyReport {
                algorithm: ferry_common::msg::HashAlgorithm::Blake3,
                record,
                size: 1,
                chunk_bytes: 1,
                chunks: 1,
                bad_count: 1,
                bad_chunks: vec![0],
            },
            replica: None,
        }
    }

    #[test]
    fn reasons_tell_damage_from_modification() {
        assert!(damaged(VerifyRecord::Current).reason().contains("damaged"));
        let kept = damaged(VerifyRecord::Stale {
            size_changed: false,
            mtime_changed: false,
        });
        assert!(kept.reason().contains("mtime kept"));
        let grown = damaged(VerifyRecord::Stale {
            size_changed: true,
            mtime_changed: true,
        });
        assert!(grown.reason().contains("size changed"));
    }
}
