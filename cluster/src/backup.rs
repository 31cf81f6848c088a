//! `rcp backup` into a cluster share: snapshots `PREFIX/<UTC timestamp>/`.
//!
//! A snapshot is built with its entries under `PREFIX/<timestamp>/...` while the
//! directory entry `PREFIX/<timestamp>` itself does not exist yet, and an entry is
//! visible only when all its ancestors exist ([`Meta::entry`], [`Meta::below`]): so
//! nothing of it can be seen until the last step puts that one entry, in one etcd
//! transaction. An interrupted run leaves an invisible subtree, which the next run's
//! tidying removes.
//!
//! The source is walked as for a backup to one node (the same include/exclude
//! rules, [`ferry_client::backup::BackupOptions`]), and the run reports in the same
//! [`BackupReport`]. A file with the same size and mtime as in the previous snapshot
//! is *linked* (unchanged): its new entry names the previous entry's layout, and no
//! byte moves (the layout is marked shared, so replacing one of its entries never
//! removes its objects). Other files are striped and uploaded as `rcp` does: changed
//! (the previous snapshot has the path) or new. A dry run reads etcd only: it plans,
//! counts, and estimates the bytes sent as every replica of every file not linked.
//! Retention (`--keep`, `--keep-days`) removes old snapshots' entries, and then the
//! objects of the layouts no entry of the share names any more.
//!
//! [`Meta::entry`]: super::Meta::entry
//! [`Meta::below`]: super::Meta::below

use std::collections::{HashMap, HashSet};
use std::os::unix::fs::MetadataExt;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Instant, SystemTime};

use crate::model::{Entry, EntryKind, Layout, ShareConfig};
use tokio::sync::Semaphore;
use tokio::task::JoinSet;

use super::copy::{below_offset, dir_entry, lock, mkdir, symlink_entry, ClusterPath};
use super::meta::Versioned;
use super::Cluster;
use ferry_client::backup::admin::{PruneReport, Retention};
use ferry_client::backup::{
    is_snapshot_name, snapshot_name, walk_source, BackupOptions, BackupReport,
};
use ferry_client::error::ClientError;
use ferry_client::filter::Filter;
use ferry_client::progress::{advance_fn, Progress};
use ferry_client::walk::{join, LocalDir};

/// One regular file of the source, planned.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct FilePlan {
    /// The local file.
    pub local: PathBuf,
    /// Its path in the share (below the snapshot's root).
    pub path: String,
    /// Its size when walked.
    pub size: u64,
    /// The previous snapshot's entry to link to (unchanged), if any.
    pub link: Option<Entry>,
    /// True if the previous snapshot has the path (changed, when not linked).
    pub had: bool,
}

/// What a snapshot will hold, as planned from the walked source and the previous
/// snapshot: every entry's path in the share, parents before children.
#[derive(Debug, Default)]
pub(super) struct Plan {
    /// The directories below the snapshot's root, with their entries.
    pub dirs: Vec<(String, Entry)>,
    /// The regular files.
    pub files: Vec<FilePlan>,
    /// The symlinks, with their entries.
    pub symlinks: Vec<(String, Entry)>,
    /// Regular files of the previous snapshot, in directories the walk visited, that
    /// the source no longer has (and the rules still cover).
    pub deleted: u64,
}

/// Plans snapshot `snap` of the walked source `tree` against the previous snapshot's
/// entries (`previous`, by path relative to its root). Pure.
pub(super) fn plan(
    tree: &[LocalDir],
    snap: &str,
    previous: &HashMap<String, Entry>,
    filter: &Filter,
) -> Plan {
    let mut plan = Plan::default();
    let mut present = HashSet::new();
    for dir in tree {
        let at = join(snap, &dir.rel);
        if !dir.rel.is_empty() {
            plan.dirs.push((at.clone(), dir_entry(dir.mode, dir.mtime)));
        }
        for f in &dir.files {
            let rel = join(&dir.rel, &f.name);
            let before = previous.get(&rel).filter(|p| p.kind == EntryKind::File);
            let link = before
                .filter(|p| p.size == f.size && p.mtime == f.mtime && p.layout.is_some())
                .cloned();
            plan.files.push(FilePlan {
                local: f.path.clone(),
                path: join(&at, &f.name),
                size: f.size,
                link,
                had: before.is_some(),
            });
            present.insert(rel);
        }
        for l in &dir.symlinks {
            let entry = symlink_entry(l.target.clone(), l.mtime);
            plan.symlinks.push((join(&at, &l.name), entry));
        }
    }
    let visited: HashSet<&str> = tree.iter().map(|d| d.rel.as_str()).collect();
    plan.deleted = previous
        .iter()
        .filter(|(rel, e)| {
            let parent = rel.rsplit_once('/').map_or("", |(p, _)| p);
            e.kind == EntryKind::File
                && visited.contains(parent)
                && !present.contains(rel.as_str())
                && !filter.excludes(rel, false)
        })
        .count() as u64;
    plan
}

/// Backs `src` up as snapshot [`snapshot_name`]`(now)` under `dest` (its path is the
/// prefix), then, unless it is a dry run, applies `retention`.
///
/// Call order: the share's configuration and the previous snapshot are read; unless
/// `opts.dry_run`, the prefix's directories are made, the snapshot's entries put
/// (invisible), its root put (published), and old snapshots tidied. Any entry that
/// fails leaves the snapshot unpublished and fails the call (each failure is logged).
pub async fn backup(
    cluster: &Cluster,
    src: &std::path::Path,
    dest: &ClusterPath,
    now: SystemTime,
    opts: &BackupOptions,
    retention: Retention,
    progress: Arc<dyn Progress>,
) -> Result<(BackupReport, PruneReport), ClientError> {
    let started = Instant::now();
    let (share, prefix) = (dest.share.as_str(), dest.path.trim_matches('/'));
    let config = cluster.meta().share(share).await?;
    let tree = walk_source(src, &opts.filter).await?;
    let root = dir_entry(tree[0].mode, tree[0].mtime);
    let name = snapshot_name(now);
    let snap = join(prefix, &name);
    let (snapshots, previous) = previous_snapshot(cluster, share, prefix, &name).await?;
    let plan = plan(&tree, &snap, &previous, &opts.filter);
    let mut report = BackupReport {
        snapshot: snap.clone(),
        previous: snapshots.last().map(|p| join(prefix, p)),
        dry_run: opts.dry_run,
        files_scanned: plan.files.len() as u64,
        files_deleted: plan.deleted,
        ..BackupReport::default()
    };
    progress.set_total(plan.files.iter().map(|f| f.size).sum());
    if opts.dry_run {
        let copies = u64::from(config.replicas).min(cluster.usable_nodes().len() as u64);
        count_dry(&plan, copies, &mut report);
        report.duration = started.elapsed();
        return Ok((report, PruneReport::default()));
    }
    let mut at = String::new();
    for part in prefix.split('/').filter(|p| !p.is_empty()) {
        at = join(&at, part);
        mkdir(cluster, share, &at, &root).await?;
    }
    let snapshot = Arc::new(Snapshot {
        cluster: cluster.clone(),
        share: share.to_owned(),
        config,
        progress,
        tally: Mutex::new(Tally::default()),
    });
    snapshot.put_all(plan, opts.jobs).await;
    let tally = std::mem::take(&mut *lock(&snapshot.tally));
    tally.into_report(&mut report, share, &snap)?;
    publish(cluster, share, prefix, &snap, &root).await?;
    let prune = tidy(cluster, share, prefix, &name, &snapshots, retention, now).await;
    report.duration = started.elapsed();
    Ok((report, prune))
}

/// Counts a dry run's `plan` into `report`: every file not linked would send its
/// bytes to `copies` nodes.
fn count_dry(plan: &Plan, copies: u64, report: &mut BackupReport) {
    for f in &plan.files {
        match (&f.link, f.had) {
            (Some(_), _) => {
                report.files_unchanged += 1;
                report.bytes_reused += f.size;
            }
            (None, had) => {
                if had {
                    report.files_changed += 1;
                } else {
                    report.files_new += 1;
                }
                report.bytes_sent += f.size * copies;
            }
        }
    }
}

/// Puts the root entry of `snap`: the whole snapshot appears at once.
async fn publish(
    cluster: &Cluster,
    share: &str,
    prefix: &str,
    snap: &str,
    root: &Entry,
) -> Result<(), ClientError> {
    match cluster.meta().commit(share, snap, root, 0).await? {
        super::meta::Commit::Done(_) => Ok(()),
        super::meta::Commit::Conflict => Err(ClientError::Cluster(format!(
            "{share}/{snap}: exists already, or {share}/{prefix} is gone"
        ))),
    }
}

/// The names of the directories right below `prefix` among `entries` (paths below
/// it, as `Meta::below` gives them).
pub(super) fn top_dirs<'a>(
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

/// What the tasks of one backup add up.
#[derive(Default)]
struct Tally {
    unchanged: u64,
    changed: u64,
    new: u64,
    bytes_sent: u64,
    bytes_reused: u64,
    /// What failed, as (path, error).
    errors: Vec<(String, ClientError)>,
}

impl Tally {
    /// Adds the counts to `report`; with errors, logs each and fails: snapshot `snap`
    /// of `share` is then not published.
    fn into_report(
        self,
        report: &mut BackupReport,
        share: &str,
        snap: &str,
    ) -> Result<(), ClientError> {
        report.files_unchanged = self.unchanged;
        report.files_changed = self.changed;
        report.files_new = self.new;
        report.bytes_sent = self.bytes_sent;
        report.bytes_reused = self.bytes_reused;
        let Some((first, e)) = self.errors.first() else {
            return Ok(());
        };
        for (path, e) in &self.errors {
            tracing::error!("{share}/{path}: {e}");
        }
        Err(ClientError::Cluster(format!(
            "snapshot {share}/{snap} not published: {} entries failed (first: {first}: {e})",
            self.errors.len()
        )))
    }
}

/// What the tasks of one backup share.
struct Snapshot {
    cluster: Cluster,
    share: String,
    config: ShareConfig,
    progress: Arc<dyn Progress>,
    tally: Mutex<Tally>,
}

impl Snapshot {
    /// Puts the planned directories (parents first), then the files (`jobs` at a
    /// time, linked or uploaded) and symlinks, each in its own task, while the
    /// snapshot is invisible. Failures go to the tally.
    async fn put_all(self: &Arc<Self>, plan: Plan, jobs: usize) {
        for (path, entry) in &plan.dirs {
            let r = self
                .cluster
                .commit_entry_with(&self.share, path, entry, false);
            if let Err(e) = r.await {
                lock(&self.tally).errors.push((path.clone(), e));
            }
        }
        let limit = Arc::new(Semaphore::new(jobs.max(1)));
        let mut tasks = JoinSet::new();
        for file in plan.files {
            let (s, limit) = (self.clone(), limit.clone());
            tasks.spawn(async move {
                let _permit = limit.acquire_owned().await;
                let r = s.put_file(&file).await;
                s.count(&file, r);
            });
        }
        for (path, entry) in plan.symlinks {
            let s = self.clone();
            tasks.spawn(async move {
                let r = s.cluster.commit_entry_with(&s.share, &path, &entry, false);
                if let Err(e) = r.await {
                    lock(&s.tally).errors.push((path, e));
                }
            });
        }
        while tasks.join_next().await.is_some() {}
    }

    /// Links `file` to its previous layout, or uploads it; returns (bytes sent,
    /// bytes reused).
    async fn put_file(&self, file: &FilePlan) -> Result<(u64, u64), ClientError> {
        let local = &file.local;
        let md =
            std::fs::metadata(local).map_err(|e| ClientError::local(local, "cannot stat", e))?;
        let linked = file
            .link
            .as_ref()
            .and_then(|p| Some((p, p.layout.as_ref()?)));
        if let Some((prev, layout)) = linked {
            self.cluster.meta().mark_shared(&layout.id).await?;
            let entry = Entry {
                mode: md.mode() & 0o7777,
                ..prev.clone()
            };
            let r = self
                .cluster
                .commit_entry_with(&self.share, &file.path, &entry, false);
            r.await?;
            self.progress.advance(prev.size);
            return Ok((0, prev.size));
        }
        let progress = advance_fn(&self.progress);
        let c = self
            .cluster
            .put_file_at(local, &self.share, &file.path, self.config, progress, false)
            .await?;
        Ok((c.bytes_sent, c.bytes_reused))
    }

    /// Counts the outcome `r` of putting `file`.
    fn count(&self, file: &FilePlan, r: Result<(u64, u64), ClientError>) {
        let mut t = lock(&self.tally);
        match r {
            Ok((sent, reused)) => {
                match (&file.link, file.had) {
                    (Some(_), _) => t.unchanged += 1,
                    (None, true) => t.changed += 1,
                    (None, false) => t.new += 1,
                }
                t.bytes_sent += sent;
                t.bytes_reused += reused;
            }
            Err(e) => t.errors.push((file.path.clone(), e)),
        }
    }
}

/// After publishing `new`: removes unpublished leftovers of earlier runs and the
/// snapshots `retention` does not keep, then the objects no entry names any more.
/// Best effort: reports what it removed and what it could not.
async fn tidy(
    cluster: &Cluster,
    share: &str,
    prefix: &str,
    new: &str,
    published: &[String],
    retention: Retention,
    now: SystemTime,
) -> PruneReport {
    let mut report = PruneReport::default();
    let all = match cluster.meta().below_all(share, prefix).await {
        Ok(all) => all,
        Err(e) => {
            report.errors.push((prefix.to_owned(), e));
            return report;
        }
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
        match remove_snapshot(cluster, share, &root).await {
            Ok(()) => {
                let base = format!("{root}/");
                dropped_layouts.extend(
                    all.iter()
                        .filter(|(p, _)| p.starts_with(&base))
                        .filter_map(|(_, v)| v.entry.layout.clone()),
                );
                report.pruned.push(root);
            }
            Err(e) => report.errors.push((root, e)),
        }
    }
    if let Err(e) = drop_unnamed(cluster, share, dropped_layouts).await {
        report.errors.push((share.to_owned(), e));
    }
    report
}

/// Removes the entries of snapshot `root` (its root first: it disappears at once).
async fn remove_snapshot(cluster: &Cluster, share: &str, root: &str) -> Result<(), ClientError> {
    if let Some(v) = cluster.meta().entry(share, root).await? {
        cluster.meta().remove(share, root, v.revision).await?;
    }
    cluster.meta().remove_below(share, root).await
}

/// Removes the objects of those of `layouts` that no entry of `share` names any more
/// (by object: a newer version may reuse, copy-on-write, a dropped layout's object).
async fn drop_unnamed(
    cluster: &Cluster,
    share: &str,
    layouts: Vec<Layout>,
) -> Result<(), ClientError> {
    if layouts.is_empty() {
        return Ok(());
    }
    let left = cluster.meta().below_all(share, "").await?;
    let left: Vec<&Layout> = left
        .iter()
        .filter_map(|(_, v)| v.entry.layout.as_ref())
        .collect();
    // A layout another entry still names stays whole, and shared (a later
    // replacement of that entry must not remove what a snapshot names).
    let named_layouts: HashSet<&str> = left.iter().map(|l| l.id.as_str()).collect();
    let named: HashSet<String> = left
        .iter()
        .flat_map(|l| (0..l.stripes.len()).map(|i| l.object_path(share, i)))
        .collect();
    let mut done = HashSet::new();
    for layout in layouts {
        if named_layouts.contains(layout.id.as_str()) || !done.insert(layout.id.clone()) {
            continue;
        }
        cluster
            .remove_objects(share, &layout, &|o| named.contains(o))
            .await;
        let _ = cluster.meta().unmark_shared(&layout.id).await;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::Stripe;
    use ferry_client::filter::{Rule, RuleKind};
    use ferry_client::walk::LocalFile;
    use ferry_common::msg::{HashAlgorithm, Owner, Timestamp};

    fn t(secs: i64) -> Timestamp {
        Timestamp { secs, nanos: 0 }
    }

    fn dir(rel: &str, children: Vec<usize>, files: &[(&str, u64, i64)]) -> LocalDir {
        LocalDir {
            rel: rel.into(),
            name: rel.rsplit('/').next().unwrap_or("").into(),
            depth: rel.split('/').filter(|p| !p.is_empty()).count(),
            mode: 0o755,
            mtime: t(1),
            owner: Owner { uid: 0, gid: 0 },
            children,
            files: files
                .iter()
                .map(|&(name, size, secs)| LocalFile {
                    name: name.into(),
                    path: PathBuf::from("/src").join(rel).join(name),
                    size,
                    mtime: t(secs),
                    owner: Owner { uid: 0, gid: 0 },
                    inode: (1, 1),
                    nlink: 1,
                })
                .collect(),
            symlinks: Vec::new(),
        }
    }

    fn file(size: u64, secs: i64) -> Entry {
        Entry {
            kind: EntryKind::File,
            mode: 0o644,
            mtime: t(secs),
            size,
            target: None,
            layout: Some(Layout {
                id: "ab".repeat(16),
                algorithm: HashAlgorithm::Blake3,
                stripe_bytes: 1 << 20,
                stripes: vec![Stripe {
                    replicas: vec!["n1".into()],
                    manifest: "00".repeat(32),
                    object: None,
                }],
            }),
        }
    }

    #[test]
    fn a_plan_links_the_unchanged_and_counts_the_deleted_that_the_rules_cover() {
        let tree = vec![
            dir(
                "",
                vec![1],
                &[("same", 5, 10), ("grown", 6, 10), ("new", 7, 10)],
            ),
            dir("d", vec![], &[]),
        ];
        let previous: HashMap<String, Entry> = [
            ("same", file(5, 10)),
            ("grown", file(5, 10)),
            ("gone", file(1, 1)),
            ("gone.tmp", file(1, 1)),
            ("d/gone", file(1, 1)),
            ("skipped/gone", file(1, 1)),
        ]
        .into_iter()
        .map(|(p, e)| (p.to_owned(), e))
        .collect();
        let filter = Filter::new(vec![Rule::new(RuleKind::Exclude, "*.tmp").unwrap()]);
        let plan = plan(&tree, "bk/S", &previous, &filter);
        assert_eq!(plan.dirs.len(), 1);
        assert_eq!(plan.dirs[0].0, "bk/S/d");
        let got: Vec<_> = plan
            .files
            .iter()
            .map(|f| (f.path.as_str(), f.link.is_some(), f.had))
            .collect();
        assert_eq!(
            got,
            [
                ("bk/S/same", true, true),
                ("bk/S/grown", false, true),
                ("bk/S/new", false, false)
            ]
        );
        // "gone" and "d/gone": visited, covered; not the excluded one, nor one in a
        // directory the walk did not visit.
        assert_eq!(plan.deleted, 2);
        let mut report = BackupReport::default();
        count_dry(&plan, 2, &mut report);
        let counts = (
            report.files_unchanged,
            report.files_changed,
            report.files_new,
        );
        assert_eq!(counts, (1, 1, 1));
        assert_eq!((report.bytes_sent, report.bytes_reused), (2 * (6 + 7), 5));
    }
}
