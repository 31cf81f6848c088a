//! `ferry cluster etcd-snapshot FILE`: the cluster's metadata (etcd's whole database:
//! shares, every namespace entry and layout, backup snapshots, members) saved to a
//! file, consistent at one etcd revision, for `etcdctl snapshot restore` (etcd 3.4;
//! `etcdutl snapshot restore` from 3.5) into a fresh etcd. The stripe objects are on
//! the nodes, not in it: a restore brings back the namespace as it was, and its files
//! read back as long as their objects are still there (`ferry cluster gc` keeps an
//! object only while a layout in etcd names it, so restore before collecting).
//!
//! Invariant: FILE appears only whole. The stream is written to a hidden file beside
//! it (`.NAME.partial`, created new), made durable, and renamed over FILE; on any
//! failure the partial file is removed and FILE is left as it was. etcd appends a
//! SHA-256 of the database to the stream, which the restore checks.

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};

use serde::Serialize;

use super::meta::Meta;
use crate::ClientError;

/// What a saved snapshot holds.
#[derive(Debug, Clone, Serialize)]
pub struct SnapshotReport {
    /// Where it was saved.
    pub path: PathBuf,
    /// Its size in bytes (the database and etcd's trailing checksum).
    pub bytes: u64,
    /// etcd's revision just before the save: every change up to it is in the
    /// snapshot (which is consistent at one revision, this one or a later one).
    pub revision: i64,
    /// The etcd version that made it.
    pub etcd_version: String,
}

/// Saves etcd's database to `path` (see the module docs).
pub async fn save(meta: &Meta, path: &Path) -> Result<SnapshotReport, ClientError> {
    let partial = partial_path(path)?;
    let local = |op: &'static str, p: &Path| {
        let p = p.to_owned();
        move |source| ClientError::Local {
            path: p,
            op,
            source,
        }
    };
    let mut file = OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(&partial)
        .map_err(local("create", &partial))?;
    let got = stream_into(meta, &mut file, &partial).await;
    let got = got.and_then(|report| {
        file.sync_all().map_err(local("fsync", &partial))?;
        std::fs::rename(&partial, path).map_err(local("rename", path))?;
        Ok(report)
    });
    let (revision, etcd_version, bytes) = match got {
        Ok(r) => r,
        Err(e) => {
            // Nothing half-written stays behind, under either name.
            let _ = std::fs::remove_file(&partial);
            return Err(e);
        }
    };
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        File::open(dir)
            .and_then(|d| d.sync_all())
            .map_err(local("fsync", dir))?;
    }
    Ok(SnapshotReport {
        path: path.to_owned(),
        bytes,
        revision,
        etcd_version,
    })
}

/// `.NAME.partial` beside `path`; refuses a path with no file name.
fn partial_path(path: &Path) -> Result<PathBuf, ClientError> {
    let name = path
        .file_name()
        .ok_or_else(|| ClientError::Usage(format!("{}: not a file name", path.display())))?;
    let mut hidden = std::ffi::OsString::from(".");
    hidden.push(name);
    hidden.push(".partial");
    Ok(path.with_file_name(hidden))
}

/// Writes etcd's snapshot stream to `file`; returns the revision, etcd's version and
/// the bytes written. The stream ends when etcd has sent everything: a stream cut
/// before (`remaining_bytes` not yet 0) is an error, not a short snapshot.
async fn stream_into(
    meta: &Meta,
    file: &mut File,
    partial: &Path,
) -> Result<(i64, String, u64), ClientError> {
    let mut etcd = meta.etcd();
    let op = "saving a snapshot (etcd's root user may be needed)";
    // Asked first: its revision is one the snapshot holds. The version decides the
    // restore tool (`etcdctl` before 3.5, `etcdutl` after).
    let status = etcd.status().await.map_err(|e| meta.err(op, e))?;
    let revision = status.header().map_or(0, |h| h.revision());
    let mut stream = etcd.snapshot().await.map_err(|e| meta.err(op, e))?;
    let (mut bytes, mut done) = (0u64, false);
    while let Some(msg) = stream.message().await.map_err(|e| meta.err(op, e))? {
        file.write_all(msg.blob())
            .map_err(|source| ClientError::Local {
                path: partial.to_owned(),
                op: "write",
                source,
            })?;
        bytes += msg.blob().len() as u64;
        done = msg.remaining_bytes() == 0;
    }
    if !done || bytes == 0 {
        return Err(ClientError::Disconnected(format!(
            "etcd's snapshot stream ended after {bytes} bytes, before its end"
        )));
    }
    Ok((revision, status.version().to_owned(), bytes))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_partial_file_is_hidden_beside_the_target() {
        assert_eq!(
            partial_path(Path::new("/backups/meta.db")).unwrap(),
            Path::new("/backups/.meta.db.partial")
        );
        assert_eq!(
            partial_path(Path::new("meta.db")).unwrap(),
            Path::new(".meta.db.partial")
        );
        assert!(partial_path(Path::new("/")).is_err());
    }
}
