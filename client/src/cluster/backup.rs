//! `rcp backup` into a cluster share: snapshots `PREFIX/<UTC timestamp>/`.
//!
//! A snapshot is built with its entries under `PREFIX/<timestamp>/...` while the
//! directory entry `PREFIX/<timestamp>` itself does not exist yet, and an entry is
//! visible only when all its ancestors exist ([`Meta::entry`], [`Meta::below`]): so
//! nothing of it can be seen until the last step puts that one entry, in one etcd
//! transaction. An interrupted run leaves an invisible subtree, which the next run's
//! tidying removes.
//!
//! A file with the same size and mtime as in the previous snapshot is *linked*: its
//! new entry names the previous entry's layout, and no byte moves (the layout is
//! marked shared, so replacing one of its entries never removes its objects). Other
//! files are striped and uploaded as `rcp` does. Retention (`--keep`, `--keep-days`)
//! removes old snapshots' entries, and then the objects of the layouts no entry of
//! the share names any more.
//!
//! [`Meta::entry`]: super::Meta::entry
//! [`Meta::below`]: super::Meta::below

use std::collections::{HashMap, HashSet};
use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::SystemTime;

use ferry_common::cluster::{Entry, EntryKind, Layout, ShareConfig};
use serde::Serialize;
use tokio::sync::Semaphore;
use tokio::task::JoinSet;

use super::copy::{
    below_offset, dir_entry, join, lock, mkdir, plan_local, symlink_entry, ClusterPath, UpItem,
};
use super::meta::Versioned;
use super::Cluster;
use crate::backup::admin::Retention;
use crate::backup::{is_snapshot_name, snapshot_name};
use crate::error::ClientError;
use crate::progress::{advance_fn, Progress};

/// What one cluster backup did.
#[derive(Debug, Default, Serialize)]
pub struct BackupReport {
    /// The snapshot's name (published only if `errors` is empty).
    pub snapshot: String,
    /// Files in it.
    pub files: u64,
    /// Directories in it.
    pub dirs: u64,
    /// Symlinks in it.
    pub symlinks: u64,
    /// Files linked to the previous snapshot's layout.
    pub unchanged: u64,
    /// Files uploaded.
    pub uploaded: u64,
    /// Bytes of the files.
    pub bytes: u64,
    /// Bytes sent to the nodes (every replica).
    pub bytes_sent: u64,
    /// Snapshots (and unpublished leftovers) removed.
    pub pruned: Vec<String>,
    /// What failed, as (path, message).
    pub errors: Vec<(String, String)>,
}

/// Backs `src` up as a new snapshot under `dest` (its path is the prefix), then
/// applies `retention`.
pub async fn backup(
    cluster: &Cluster,
    src: &Path,
    dest: &ClusterPath,
    retention: Retention,
    jobs: usize,
    progress: Arc<dyn Progress>,
) -> Result<BackupReport, ClientError> {
    let share = dest.share.clone();
    let prefix = dest.path.clone();
    let config = cluster.meta().share(&share).await?;
    let md = std::fs::metadata(src).map_err(|e| ClientError::local(src, "cannot stat", e))?;
    if !md.is_dir() {
        return Err(ClientError::local(
            src,
            "cannot back up",
            std::io::Error::from(std::io::ErrorKind::NotADirectory),
        ));
    }
    // The prefix's directories, visible.
    let mut at = String::new();
    for part in prefix.split('/').filter(|p| !p.is_empty()) {
        at = join(&at, part);
        mkdir(cluster, &share, &at, &dir_entry_of(&md)).await?;
    }
    let now = SystemTime::now();
    let name = snapshot_name(now);
    let snap = join(&prefix, &name);
    let (snapshots, previous) = previous_snapshot(cluster, &share, &prefix, &name).await?;

    let mut items = Vec::new();
    let mut total = 0;
    let mut skipped = Vec::new();
    plan_local(src, &snap, true, &mut items, &mut total, &mut skipped)?;
    progress.set_total(total);
    let report = Arc::new(Mutex::new(BackupReport {
        snapshot: name.clone(),
        ..BackupReport::default()
    }));
    put_dirs(cluster, &share, &snap, &items, &report).await;
    let snapshot = Snapshot {
        cluster: cluster.clone(),
        share: share.clone(),
        root: snap.clone(),
        previous: Arc::new(previous),
        config,
        progress,
        report: report.clone(),
    };
    put_files_and_links(Arc::new(snapshot), items, jobs).await;
    let mut report = Arc::try_unwrap(report)
        .map(|m| m.into_inner().unwrap_or_else(|p| p.into_inner()))
        .unwrap_or_default();
    for s in skipped {
        report.errors.push((
            s,
            "skipped: not a regular file, directory or symlink".into(),
        ));
    }
    if !report.errors.is_empty() {
        // Not published: the subtree stays invisible and the next run removes it.
        return Ok(report);
    }
    // Publication: one entry makes the whole snapshot visible.
    match cluster
        .meta()
        .commit(&share, &snap, &dir_entry_of(&md), 0)
        .await?
    {
        super::meta::Commit::Done(_) => {}
        super::meta::Commit::Conflict => {
            return Err(ClientError::Cluster(format!(
                "{share}/{snap}: exists already, or {share}/{prefix} is gone"
            )))
        }
    }
    report.dirs += 1;
    report.pruned = tidy(cluster, &share, &prefix, &name, &snapshots, retention, now).await;
    Ok(report)
}

/// The names of the directories right below `prefix` among `entries` (paths below
/// it, as `Meta::below` gives them).
fn top_dirs<'a>(
    entries: &'a [(String, Versioned)],
    prefix: &str,
) -> impl Iterator<Item = String> + 'a {
    let depth = below_offset(prefix);
    entries
        .iter()
        .filter(move |(p, v)| v.entry.kind == EntryKind::Dir && !p[depth..].contains('/'))
        .map(move |(p, _)| p[depth..].to_owned())
}

/// The published snapshots under `prefix` older than `name` (sorted), and the
/// entries of the newest of them by path relative to its root (empty if none).
async fn previous_snapshot(
    cluster: &Cluster,
    share: &str,
    prefix: &str,
    name: &str,
) -> Result<(Vec<String>, HashMap<String, Entry>), ClientError> {
    let existing = cluster.meta().below(share, prefix).await?;
    let mut snapshots: Vec<String> = top_dirs(&existing, prefix)
        .filter(|n| is_snapshot_name(n) && n.as_str() < name)
        .collect();
    snapshots.sort();
    let previous = match snapshots.last() {
        Some(prev) => {
            let base = format!("{}/", join(prefix, prev));
            existing
                .iter()
                .filter_map(|(p, v)| {
                    p.strip_prefix(&base)
                        .map(|rel| (rel.to_owned(), v.entry.clone()))
                })
                .collect()
        }
        None => HashMap::new(),
    };
    Ok((snapshots, previous))
}

/// Puts the planned directories but the snapshot's root `snap` (it is published
/// last), parents before children, while the snapshot is invisible.
async fn put_dirs(
    cluster: &Cluster,
    share: &str,
    snap: &str,
    items: &[UpItem],
    report: &Mutex<BackupReport>,
) {
    for item in items {
        if let UpItem::Dir { path, mode, mtime } = item {
            if *path == snap {
                continue;
            }
            let entry = dir_entry(*mode, *mtime);
            match cluster.commit_entry_with(share, path, &entry, false).await {
                Ok(_) => lock(report).dirs += 1,
                Err(e) => lock(report).errors.push((path.clone(), e.to_string())),
            }
        }
    }
}

/// What the tasks of one backup share.
struct Snapshot {
    cluster: Cluster,
    share: String,
    /// The snapshot's root path in the share.
    root: String,
    /// The previous snapshot's entries, by path relative to its root.
    previous: Arc<HashMap<String, Entry>>,
    config: ShareConfig,
    progress: Arc<dyn Progress>,
    report: Arc<Mutex<BackupReport>>,
}

/// Puts the planned files (`jobs` at a time, linked or uploaded) and symlinks, each
/// in its own task, while the snapshot is invisible.
async fn put_files_and_links(snapshot: Arc<Snapshot>, items: Vec<UpItem>, jobs: usize) {
    let limit = Arc::new(Semaphore::new(jobs.max(1)));
    let mut tasks = JoinSet::new();
    for item in items {
        let s = snapshot.clone();
        match item {
            UpItem::Dir { .. } => {}
            UpItem::File { local, path } => {
                let limit = limit.clone();
                tasks.spawn(async move {
                    let _permit = limit.acquire_owned().await;
                    s.put_file(&local, &path).await
                });
            }
            UpItem::Symlink {
                path,
                target,
                mtime,
            } => {
                tasks.spawn(async move {
                    let entry = symlink_entry(target, mtime);
                    let r = s
                        .cluster
                        .commit_entry_with(&s.share, &path, &entry, false)
                        .await;
                    let mut rep = lock(&s.report);
                    match r {
                        Ok(_) => rep.symlinks += 1,
                        Err(e) => rep.errors.push((path, e.to_string())),
                    }
                });
            }
        }
    }
    while tasks.join_next().await.is_some() {}
}

impl Snapshot {
    /// Backs up the file `local` at `path` ([`back_up_file`]) and records the outcome.
    async fn put_file(&self, local: &Path, path: &str) {
        let rel = path
            .strip_prefix(&format!("{}/", self.root))
            .unwrap_or(path);
        let r = back_up_file(
            &self.cluster,
            &self.share,
            local,
            path,
            rel,
            &self.previous,
            self.config,
            &self.progress,
        )
        .await;
        let mut rep = lock(&self.report);
        match r {
            Ok((bytes, sent, linked)) => {
                rep.files += 1;
                rep.bytes += bytes;
                rep.bytes_sent += sent;
                if linked {
                    rep.unchanged += 1;
                } else {
                    rep.uploaded += 1;
                }
            }
            Err(e) => rep
                .errors
                .push((local.display().to_string(), e.to_string())),
        }
    }
}

fn dir_entry_of(md: &std::fs::Metadata) -> Entry {
    dir_entry(
        md.mode() & 0o7777,
        ferry_common::attr::attr_of(md, None).mtime,
    )
}

/// One file: linked to the previous snapshot's layout when its size and mtime did
/// not change, else uploaded. Returns (bytes, bytes sent, linked).
#[allow(clippy::too_many_arguments)]
async fn back_up_file(
    cluster: &Cluster,
    share: &str,
    local: &Path,
    path: &str,
    rel: &str,
    previous: &HashMap<String, Entry>,
    config: ShareConfig,
    progress: &Arc<dyn Progress>,
) -> Result<(u64, u64, bool), ClientError> {
    let md = std::fs::metadata(local).map_err(|e| ClientError::local(local, "cannot stat", e))?;
    let mtime = ferry_common::attr::attr_of(&md, None).mtime;
    if let Some(prev) = previous.get(rel).filter(|p| {
        p.kind == EntryKind::File && p.size == md.len() && p.mtime == mtime && p.layout.is_some()
    }) {
        let layout: &Layout = prev.layout.as_ref().expect("checked");
        cluster.meta().mark_shared(&layout.id).await?;
        let entry = Entry {
            mode: md.mode() & 0o7777,
            ..prev.clone()
        };
        cluster
            .commit_entry_with(share, path, &entry, false)
            .await?;
        progress.advance(md.len());
        return Ok((md.len(), 0, true));
    }
    let c = cluster
        .put_file_at(local, share, path, config, advance_fn(progress), false)
        .await?;
    Ok((c.bytes, c.bytes_sent, false))
}

/// After publishing `new`: removes unpublished leftovers of earlier runs and the
/// snapshots `retention` does not keep, then the objects no entry names any more.
/// Best effort: returns what it removed.
async fn tidy(
    cluster: &Cluster,
    share: &str,
    prefix: &str,
    new: &str,
    published: &[String],
    retention: Retention,
    now: SystemTime,
) -> Vec<String> {
    let mut removed = Vec::new();
    let Ok(all) = cluster.meta().below_all(share, prefix).await else {
        return removed;
    };
    let depth = below_offset(prefix);
    let top = |p: &str| p[depth..].split('/').next().unwrap_or("").to_owned();
    let present: HashSet<String> = top_dirs(&all, prefix).collect();
    // Leftovers: snapshot-named subtrees older than `new` whose root was never put.
    let mut doomed: Vec<String> = all
        .iter()
        .map(|(p, _)| top(p))
        .filter(|t| is_snapshot_name(t) && t.as_str() < new && !present.contains(t))
        .collect::<HashSet<_>>()
        .into_iter()
        .collect();
    let mut names: Vec<String> = published.to_vec();
    names.push(new.to_owned());
    doomed.extend(retention.doomed(&names, new, now));
    let mut dropped_layouts: Vec<Layout> = Vec::new();
    for name in doomed {
        let root = join(prefix, &name);
        let ok = async {
            if let Some(v) = cluster.meta().entry(share, &root).await? {
                cluster.meta().remove(share, &root, v.revision).await?;
            }
            cluster.meta().remove_below(share, &root).await
        }
        .await;
        match ok {
            Ok(()) => {
                let base = format!("{root}/");
                dropped_layouts.extend(
                    all.iter()
                        .filter(|(p, _)| p.starts_with(&base))
                        .filter_map(|(_, v)| v.entry.layout.clone()),
                );
                removed.push(format!("{share}/{root}"));
            }
            Err(e) => tracing::warn!("cannot remove {share}/{root}: {e}"),
        }
    }
    if dropped_layouts.is_empty() {
        return removed;
    }
    // Objects go only when no entry of the share names their layout any more.
    let Ok(left) = cluster.meta().below_all(share, "").await else {
        return removed;
    };
    // By object: a newer version may reuse (copy-on-write) a dropped layout's object.
    let named: HashSet<String> = left
        .iter()
        .filter_map(|(_, v)| v.entry.layout.as_ref())
        .flat_map(|l| (0..l.stripes.len()).map(|i| l.object_path(share, i)))
        .collect();
    let mut done = HashSet::new();
    for layout in dropped_layouts {
        if !done.insert(layout.id.clone()) {
            continue;
        }
        cluster
            .remove_objects(share, &layout, &|o| named.contains(o))
            .await;
        let _ = cluster.meta().unmark_shared(&layout.id).await;
    }
    removed
}
