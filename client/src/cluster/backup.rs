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

use ferry_common::cluster::{Entry, EntryKind, Layout};
use serde::Serialize;
use tokio::sync::Semaphore;
use tokio::task::JoinSet;

use super::copy::{mkdir, plan_local, ClusterPath, UpItem};
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

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn join(a: &str, b: &str) -> String {
    if a.is_empty() {
        b.to_owned()
    } else {
        format!("{a}/{b}")
    }
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
        mkdir(cluster, &share, &at, &dir_entry(&md)).await?;
    }
    let now = SystemTime::now();
    let name = snapshot_name(now);
    let snap = join(&prefix, &name);
    let existing = cluster.meta().below(&share, &prefix).await?;
    let depth = if prefix.is_empty() {
        0
    } else {
        prefix.len() + 1
    };
    let mut snapshots: Vec<String> = existing
        .iter()
        .filter(|(p, v)| v.entry.kind == EntryKind::Dir && !p[depth..].contains('/'))
        .map(|(p, _)| p[depth..].to_owned())
        .filter(|n| is_snapshot_name(n) && *n < name)
        .collect();
    snapshots.sort();
    let previous: HashMap<String, Entry> = match snapshots.last() {
        Some(prev) => {
            let base = format!("{}/", join(&prefix, prev));
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

    let mut items = Vec::new();
    let mut total = 0;
    let mut skipped = Vec::new();
    plan_local(src, &snap, true, &mut items, &mut total, &mut skipped)?;
    progress.set_total(total);
    let report = Arc::new(Mutex::new(BackupReport {
        snapshot: name.clone(),
        ..BackupReport::default()
    }));
    // Directories first (parents before children), all but the snapshot's root.
    for item in &items {
        if let UpItem::Dir { path, mode, mtime } = item {
            if *path == snap {
                continue;
            }
            let entry = Entry {
                kind: EntryKind::Dir,
                mode: *mode,
                mtime: *mtime,
                size: 0,
                target: None,
                layout: None,
            };
            match cluster.commit_entry_with(&share, path, &entry, false).await {
                Ok(_) => lock(&report).dirs += 1,
                Err(e) => lock(&report).errors.push((path.clone(), e.to_string())),
            }
        }
    }
    let limit = Arc::new(Semaphore::new(jobs.max(1)));
    let previous = Arc::new(previous);
    let mut tasks = JoinSet::new();
    for item in items {
        let (cluster, share, report, limit, progress, previous) = (
            cluster.clone(),
            share.clone(),
            report.clone(),
            limit.clone(),
            progress.clone(),
            previous.clone(),
        );
        let rel_of = {
            let snap = snap.clone();
            move |p: &str| p.strip_prefix(&format!("{snap}/")).unwrap_or(p).to_owned()
        };
        match item {
            UpItem::Dir { .. } => {}
            UpItem::File { local, path } => {
                tasks.spawn(async move {
                    let _permit = limit.acquire_owned().await;
                    let r = back_up_file(
                        &cluster,
                        &share,
                        &local,
                        &path,
                        &rel_of(&path),
                        &previous,
                        config,
                        &progress,
                    )
                    .await;
                    let mut rep = lock(&report);
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
                });
            }
            UpItem::Symlink {
                path,
                target,
                mtime,
            } => {
                tasks.spawn(async move {
                    let entry = Entry {
                        kind: EntryKind::Symlink,
                        mode: 0o777,
                        mtime,
                        size: target.len() as u64,
                        target: Some(target),
                        layout: None,
                    };
                    let r = cluster
                        .commit_entry_with(&share, &path, &entry, false)
                        .await;
                    let mut rep = lock(&report);
                    match r {
                        Ok(_) => rep.symlinks += 1,
                        Err(e) => rep.errors.push((path, e.to_string())),
                    }
                });
            }
        }
    }
    while tasks.join_next().await.is_some() {}
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
        .commit(&share, &snap, &dir_entry(&md), 0)
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

fn dir_entry(md: &std::fs::Metadata) -> Entry {
    Entry {
        kind: EntryKind::Dir,
        mode: md.mode() & 0o7777,
        mtime: ferry_common::attr::attr_of(md, None).mtime,
        size: 0,
        target: None,
        layout: None,
    }
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
    config: ferry_common::cluster::ShareConfig,
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
    let depth = if prefix.is_empty() {
        0
    } else {
        prefix.len() + 1
    };
    let top = |p: &str| p[depth..].split('/').next().unwrap_or("").to_owned();
    let present: HashSet<String> = all
        .iter()
        .filter(|(p, v)| v.entry.kind == EntryKind::Dir && !p[depth..].contains('/'))
        .map(|(p, _)| p[depth..].to_owned())
        .collect();
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
    let named: HashSet<String> = left
        .iter()
        .filter_map(|(_, v)| v.entry.layout.as_ref().map(|l| l.id.clone()))
        .collect();
    let mut done = HashSet::new();
    for layout in dropped_layouts {
        if named.contains(&layout.id) || !done.insert(layout.id.clone()) {
            continue;
        }
        cluster.remove_objects(share, &layout).await;
        let _ = cluster.meta().unmark_shared(&layout.id).await;
    }
    removed
}
