//! `rcp` on cluster shares: cp/scp semantics for files and trees, both directions.
//!
//! Up: a directory operand needs `-r`; directories become entries first (pre-order),
//! then files (`jobs` at a time, each striped over the nodes) and symlinks, with their
//! modes and mtimes. Down: a directory's whole subtree is one etcd range read; local
//! directories are created first, files fetched `jobs` at a time, and directory mtimes
//! set deepest first at the end. A failing item is recorded and the rest goes on.

use std::fs;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use ferry_common::cluster::{Entry, EntryKind, ShareConfig};
use ferry_common::msg::{ErrorKind, RemoteError};
use tokio::sync::Semaphore;
use tokio::task::JoinSet;

use super::Cluster;
use crate::copy::{CopyOptions, ItemError, Report};
use crate::error::ClientError;
use crate::progress::{advance_fn, Progress};
use crate::transfer::Copied;

/// A place in a cluster share: `cluster://ETCD_HOST[:PORT]/SHARE[/PATH]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClusterPath {
    /// etcd's `HOST:PORT`.
    pub etcd: String,
    /// The cluster share.
    pub share: String,
    /// The path in it, normalised (`""`: the root).
    pub path: String,
    /// The operand ended with `/`: it names a directory.
    pub dir_hint: bool,
}

impl ClusterPath {
    /// The operand as a user would write it.
    pub fn display(&self) -> String {
        if self.path.is_empty() {
            format!("cluster://{}/{}", self.etcd, self.share)
        } else {
            format!("cluster://{}/{}/{}", self.etcd, self.share, self.path)
        }
    }

    /// `self` with `name` appended.
    pub fn join(&self, name: &str) -> ClusterPath {
        ClusterPath {
            path: join(&self.path, name),
            dir_hint: false,
            ..self.clone()
        }
    }

    /// The last component (the share's name for its root).
    pub fn base_name(&self) -> &str {
        self.path
            .rsplit('/')
            .next()
            .filter(|s| !s.is_empty())
            .unwrap_or(&self.share)
    }
}

fn join(dir: &str, name: &str) -> String {
    if dir.is_empty() {
        name.to_owned()
    } else {
        format!("{dir}/{name}")
    }
}

/// Parses `cluster://HOST[:PORT]/SHARE[/PATH]`; `None` if `arg` is not a cluster URL.
pub fn parse(arg: &str) -> Option<Result<ClusterPath, ClientError>> {
    let rest = arg.strip_prefix("cluster://")?;
    let usage = |why: &str| ClientError::Usage(format!("{arg}: {why}"));
    Some((|| {
        let (host, rest) = rest
            .split_once('/')
            .ok_or_else(|| usage("expected cluster://ETCD_HOST[:PORT]/SHARE[/PATH]"))?;
        if host.is_empty() {
            return Err(usage("empty etcd host"));
        }
        let etcd = if host.ends_with(']') || !host.contains(':') {
            format!("{host}:{}", super::DEFAULT_ETCD_PORT)
        } else {
            host.to_owned()
        };
        let (share, path) = rest.split_once('/').unwrap_or((rest, ""));
        if !ferry_common::cluster::valid_share_name(share) {
            return Err(usage("missing or invalid share name"));
        }
        let parts = ferry_common::path::components(path).map_err(|e| usage(&e.to_string()))?;
        Ok(ClusterPath {
            etcd,
            share: share.to_owned(),
            path: parts.join("/"),
            dir_hint: path.ends_with('/') || path.is_empty(),
        })
    })())
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn remote(kind: ErrorKind, message: String) -> ClientError {
    ClientError::Remote(RemoteError { kind, message })
}

/// What one copy records.
struct Tally {
    report: Mutex<Report>,
}

impl Tally {
    fn fail(&self, path: String, error: ClientError) {
        lock(&self.report).errors.push(ItemError { path, error });
    }
    fn copied(&self, c: Copied) {
        let mut r = lock(&self.report);
        r.files += 1;
        r.bytes += c.bytes;
        r.bytes_sent += c.bytes_sent;
        r.bytes_reused += c.bytes_reused;
    }
}

/// A local item to upload, planned.
pub(super) enum UpItem {
    Dir {
        path: String,
        mode: u32,
        mtime: ferry_common::msg::Timestamp,
    },
    File {
        local: PathBuf,
        path: String,
    },
    Symlink {
        path: String,
        target: String,
        mtime: ferry_common::msg::Timestamp,
    },
}

pub(super) fn plan_local(
    local: &Path,
    target: &str,
    recursive: bool,
    items: &mut Vec<UpItem>,
    total: &mut u64,
    skipped: &mut Vec<String>,
) -> Result<(), ClientError> {
    let md =
        fs::symlink_metadata(local).map_err(|e| ClientError::local(local, "cannot stat", e))?;
    let mtime = ferry_common::attr::attr_of(&md, None).mtime;
    if md.file_type().is_symlink() {
        let t =
            fs::read_link(local).map_err(|e| ClientError::local(local, "cannot read link", e))?;
        items.push(UpItem::Symlink {
            path: target.to_owned(),
            target: t.to_string_lossy().into_owned(),
            mtime,
        });
    } else if md.is_file() {
        *total += md.len();
        items.push(UpItem::File {
            local: local.to_owned(),
            path: target.to_owned(),
        });
    } else if md.is_dir() {
        if !recursive {
            return Err(ClientError::local(
                local,
                "cannot copy",
                std::io::Error::other("is a directory (use -r)"),
            ));
        }
        items.push(UpItem::Dir {
            path: target.to_owned(),
            mode: md.mode() & 0o7777,
            mtime,
        });
        let mut children: Vec<_> = fs::read_dir(local)
            .map_err(|e| ClientError::local(local, "cannot list", e))?
            .filter_map(|e| e.ok())
            .collect();
        children.sort_by_key(|e| e.file_name());
        for child in children {
            let name = child.file_name().to_string_lossy().into_owned();
            plan_local(
                &child.path(),
                &join(target, &name),
                true,
                items,
                total,
                skipped,
            )?;
        }
    } else {
        skipped.push(local.display().to_string());
    }
    Ok(())
}

/// Uploads `sources` to `dest` (scp semantics) with `opts.jobs` files in flight.
pub async fn upload(
    cluster: &Cluster,
    sources: &[PathBuf],
    dest: &ClusterPath,
    opts: &CopyOptions,
    replicas: Option<u8>,
    progress: Arc<dyn Progress>,
) -> Report {
    let tally = Arc::new(Tally {
        report: Mutex::new(Report::default()),
    });
    let r = upload_inner(cluster, sources, dest, opts, replicas, progress, &tally).await;
    if let Err(e) = r {
        tally.fail(dest.display(), e);
    }
    let report = std::mem::take(&mut *lock(&tally.report));
    report
}

async fn upload_inner(
    cluster: &Cluster,
    sources: &[PathBuf],
    dest: &ClusterPath,
    opts: &CopyOptions,
    replicas: Option<u8>,
    progress: Arc<dyn Progress>,
    tally: &Arc<Tally>,
) -> Result<(), ClientError> {
    let mut config: ShareConfig = cluster.meta().share(&dest.share).await?;
    if let Some(r) = replicas {
        config.replicas = r;
        config.validate().map_err(ClientError::Usage)?;
    }
    let existing = cluster.meta().entry(&dest.share, &dest.path).await?;
    let dest_is_dir = existing
        .as_ref()
        .is_some_and(|v| v.entry.kind == EntryKind::Dir);
    if !dest_is_dir && (sources.len() > 1 || dest.dir_hint) {
        return Err(remote(
            ErrorKind::NotFound,
            format!("{}: no such directory", dest.display()),
        ));
    }
    let mut items = Vec::new();
    let mut total = 0;
    let mut skipped = Vec::new();
    for src in sources {
        let name = src
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        let target = if dest_is_dir {
            join(&dest.path, &name)
        } else {
            dest.path.clone()
        };
        if let Err(e) = plan_local(
            src,
            &target,
            opts.recursive,
            &mut items,
            &mut total,
            &mut skipped,
        ) {
            tally.fail(src.display().to_string(), e);
        }
    }
    lock(&tally.report).skipped = skipped;
    progress.set_total(total);
    let share = dest.share.clone();
    // Directories first, in pre-order (parents before children), one at a time.
    for item in &items {
        if let UpItem::Dir { path, mode, mtime } = item {
            let entry = Entry {
                kind: EntryKind::Dir,
                mode: *mode,
                mtime: *mtime,
                size: 0,
                target: None,
                layout: None,
            };
            match mkdir(cluster, &share, path, &entry).await {
                Ok(()) => lock(&tally.report).dirs += 1,
                Err(e) => tally.fail(format!("{}/{path}", dest.display()), e),
            }
        }
    }
    let limit = Arc::new(Semaphore::new(opts.jobs.max(1)));
    let mut tasks = JoinSet::new();
    for item in items {
        let (cluster, share, tally, limit, progress) = (
            cluster.clone(),
            share.clone(),
            tally.clone(),
            limit.clone(),
            progress.clone(),
        );
        let shown = dest.clone();
        match item {
            UpItem::Dir { .. } => {}
            UpItem::File { local, path } => {
                tasks.spawn(async move {
                    let _permit = limit.acquire_owned().await;
                    match cluster
                        .put_file(&local, &share, &path, config, advance_fn(&progress))
                        .await
                    {
                        Ok(c) => tally.copied(c),
                        Err(e) if e.remote_kind().is_some() => {
                            tally.fail(format!("{}/{path}", display_root(&shown)), e)
                        }
                        Err(e) => tally.fail(local.display().to_string(), e),
                    }
                });
            }
            UpItem::Symlink {
                path,
                target,
                mtime,
            } => {
                let entry = Entry {
                    kind: EntryKind::Symlink,
                    mode: 0o777,
                    mtime,
                    size: target.len() as u64,
                    target: Some(target),
                    layout: None,
                };
                tasks.spawn(async move {
                    match cluster.commit_entry(&share, &path, &entry).await {
                        Ok(old) => {
                            lock(&tally.report).symlinks += 1;
                            if let Some(l) = old.and_then(|o| o.layout) {
                                cluster.remove_unshared(&share, &l).await;
                            }
                        }
                        Err(e) => tally.fail(format!("{}/{path}", display_root(&shown)), e),
                    }
                });
            }
        }
    }
    while tasks.join_next().await.is_some() {}
    Ok(())
}

fn display_root(p: &ClusterPath) -> String {
    format!("cluster://{}/{}", p.etcd, p.share)
}

/// Creates directory `path` unless one is there.
pub(super) async fn mkdir(
    cluster: &Cluster,
    share: &str,
    path: &str,
    entry: &Entry,
) -> Result<(), ClientError> {
    if path.is_empty() {
        return Ok(());
    }
    match cluster.meta().entry(share, path).await? {
        Some(v) if v.entry.kind == EntryKind::Dir => return Ok(()),
        Some(_) => {
            return Err(remote(
                ErrorKind::Exists,
                format!("{share}/{path}: exists and is not a directory"),
            ))
        }
        None => {}
    }
    match cluster.meta().commit(share, path, entry, 0).await? {
        super::meta::Commit::Done(_) => Ok(()),
        super::meta::Commit::Conflict => match cluster.meta().entry(share, path).await? {
            Some(v) if v.entry.kind == EntryKind::Dir => Ok(()),
            Some(_) => Err(remote(
                ErrorKind::Exists,
                format!("{share}/{path}: exists and is not a directory"),
            )),
            None => Err(remote(
                ErrorKind::NotFound,
                format!("{share}/{path}: the parent directory does not exist"),
            )),
        },
    }
}

/// Downloads `sources` to the local `dest` (scp semantics) with `opts.jobs` files in
/// flight.
pub async fn download(
    cluster: &Cluster,
    sources: &[ClusterPath],
    dest: &Path,
    opts: &CopyOptions,
    progress: Arc<dyn Progress>,
) -> Report {
    let tally = Arc::new(Tally {
        report: Mutex::new(Report::default()),
    });
    let dest_is_dir = dest.is_dir();
    if sources.len() > 1 && !dest_is_dir {
        tally.fail(
            dest.display().to_string(),
            ClientError::local(
                dest,
                "cannot copy into",
                std::io::Error::from(std::io::ErrorKind::NotFound),
            ),
        );
        let report = std::mem::take(&mut *lock(&tally.report));
        return report;
    }
    // Everything to fetch: (cluster path, entry, local target).
    let mut files: Vec<(ClusterPath, Entry, PathBuf)> = Vec::new();
    let mut dirs: Vec<(PathBuf, Entry)> = Vec::new();
    let mut total = 0;
    for src in sources {
        let target = if dest_is_dir {
            dest.join(src.base_name())
        } else {
            dest.to_owned()
        };
        let root = match cluster.meta().existing(&src.share, &src.path).await {
            Ok(v) => v.entry,
            Err(e) => {
                tally.fail(src.display(), e);
                continue;
            }
        };
        match root.kind {
            EntryKind::Dir if !opts.recursive => tally.fail(
                src.display(),
                ClientError::Usage(format!("{}: is a directory (use -r)", src.display())),
            ),
            EntryKind::Dir => {
                let below = match cluster.meta().below(&src.share, &src.path).await {
                    Ok(b) => b,
                    Err(e) => {
                        tally.fail(src.display(), e);
                        continue;
                    }
                };
                dirs.push((target.clone(), root));
                let strip = if src.path.is_empty() {
                    0
                } else {
                    src.path.len() + 1
                };
                for (path, v) in below {
                    let local = target.join(&path[strip..]);
                    match v.entry.kind {
                        EntryKind::Dir => dirs.push((local, v.entry)),
                        _ => {
                            total += v.entry.size;
                            let cp = ClusterPath {
                                path,
                                dir_hint: false,
                                ..src.clone()
                            };
                            files.push((cp, v.entry, local));
                        }
                    }
                }
            }
            _ => {
                total += root.size;
                files.push((src.clone(), root, target));
            }
        }
    }
    progress.set_total(total);
    // Directories in pre-order (keys sort parents first), owner-writable until the end.
    dirs.sort_by(|a, b| a.0.cmp(&b.0));
    for (d, _) in &dirs {
        match fs::create_dir(d) {
            Ok(()) => lock(&tally.report).dirs += 1,
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists && d.is_dir() => {
                lock(&tally.report).dirs += 1
            }
            Err(e) => tally.fail(
                d.display().to_string(),
                ClientError::local(d, "cannot create", e),
            ),
        }
    }
    let limit = Arc::new(Semaphore::new(opts.jobs.max(1)));
    let mut tasks = JoinSet::new();
    for (src, entry, local) in files {
        let (cluster, tally, limit, progress) = (
            cluster.clone(),
            tally.clone(),
            limit.clone(),
            progress.clone(),
        );
        tasks.spawn(async move {
            let _permit = limit.acquire_owned().await;
            match entry.kind {
                EntryKind::Symlink => {
                    let target = entry.target.clone().unwrap_or_default();
                    let _ = fs::remove_file(&local);
                    match std::os::unix::fs::symlink(&target, &local) {
                        Ok(()) => {
                            let t = nix::sys::time::TimeSpec::new(
                                entry.mtime.secs,
                                i64::from(entry.mtime.nanos),
                            );
                            let _ = nix::sys::stat::utimensat(
                                None,
                                &local,
                                &t,
                                &t,
                                nix::sys::stat::UtimensatFlags::NoFollowSymlink,
                            );
                            lock(&tally.report).symlinks += 1;
                        }
                        Err(e) => tally.fail(
                            local.display().to_string(),
                            ClientError::local(&local, "cannot create symlink", e),
                        ),
                    }
                }
                _ => match cluster
                    .get_file(&src.share, &src.path, &entry, &local, advance_fn(&progress))
                    .await
                {
                    Ok(c) => tally.copied(c),
                    Err(e @ ClientError::Local { .. }) => {
                        tally.fail(local.display().to_string(), e)
                    }
                    Err(e) => tally.fail(src.display(), e),
                },
            }
        });
    }
    while tasks.join_next().await.is_some() {}
    // Directory modes and mtimes, deepest first.
    for (d, entry) in dirs.iter().rev() {
        let _ = fs::set_permissions(d, fs::Permissions::from_mode(entry.mode & 0o7777));
        if entry.mtime != ferry_common::msg::Timestamp::default() {
            if let Ok(f) = fs::File::open(d) {
                let _ = f.set_modified(entry.mtime.to_system());
            }
        }
    }
    let report = std::mem::take(&mut *lock(&tally.report));
    report
}
