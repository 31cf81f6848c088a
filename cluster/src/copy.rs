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

use crate::model::{Entry, EntryKind, ShareConfig};
use ferry_common::msg::{ErrorKind, RemoteError, Timestamp};
use tokio::sync::Semaphore;
use tokio::task::JoinSet;

use super::Cluster;
use ferry_client::copy::{CopyOptions, ItemError, Report};
use ferry_client::error::ClientError;
use ferry_client::progress::{advance_fn, Progress};
use ferry_client::transfer::Copied;

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

/// `name` in directory `dir` (`""`: the root).
pub(super) fn join(dir: &str, name: &str) -> String {
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
        if !crate::model::valid_share_name(share) {
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

pub(super) fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn remote(kind: ErrorKind, message: String) -> ClientError {
    ClientError::Remote(RemoteError { kind, message })
}

/// Where the path of an entry below directory `dir` (`""`: the root) starts its part
/// relative to `dir`: `&path[below_offset(dir)..]`.
pub(super) fn below_offset(dir: &str) -> usize {
    if dir.is_empty() {
        0
    } else {
        dir.len() + 1
    }
}

/// The entry of a directory with `mode` and `mtime`.
pub(super) fn dir_entry(mode: u32, mtime: Timestamp) -> Entry {
    Entry {
        kind: EntryKind::Dir,
        mode,
        mtime,
        size: 0,
        target: None,
        layout: None,
    }
}

/// The entry of a symlink to `target` with `mtime`.
pub(super) fn symlink_entry(target: String, mtime: Timestamp) -> Entry {
    Entry {
        kind: EntryKind::Symlink,
        mode: 0o777,
        mtime,
        size: target.len() as u64,
        target: Some(target),
        layout: None,
    }
}

/// What one copy records.
struct Tally {
    report: Mutex<Report>,
}

impl Tally {
    /// An empty report, shared by a copy's tasks.
    fn new() -> Arc<Tally> {
        Arc::new(Tally {
            report: Mutex::new(Report::default()),
        })
    }
    fn fail(&self, path: String, error: ClientError) {
        lock(&self.report).errors.push(ItemError { path, error });
    }
    fn put(&self, p: super::files::Put) {
        self.copied(p.copied);
        let mut r = lock(&self.report);
        r.stripes_sent += p.stripes_sent;
        r.stripes_reused += p.stripes_reused;
    }
    fn copied(&self, c: Copied) {
        let mut r = lock(&self.report);
        r.files += 1;
        r.bytes += c.bytes;
        r.bytes_sent += c.bytes_sent;
        r.bytes_reused += c.bytes_reused;
    }
    /// The report so far, leaving an empty one.
    fn take(&self) -> Report {
        std::mem::take(&mut *lock(&self.report))
    }
}

/// A local item to upload, planned.
pub(super) enum UpItem {
    Dir {
        path: String,
        mode: u32,
        mtime: Timestamp,
    },
    File {
        local: PathBuf,
        path: String,
    },
    Symlink {
        path: String,
        target: String,
        mtime: Timestamp,
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
    let tally = Tally::new();
    let r = upload_inner(cluster, sources, dest, opts, replicas, progress, &tally).await;
    if let Err(e) = r {
        tally.fail(dest.display(), e);
    }
    tally.take()
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
    let dest_is_dir = upload_dest_is_dir(cluster, sources.len(), dest).await?;
    let (items, total) = plan_upload(sources, dest, dest_is_dir, opts.recursive, tally);
    progress.set_total(total);
    upload_dirs(cluster, &items, dest, tally).await;
    let limit = Arc::new(Semaphore::new(opts.jobs.max(1)));
    let mut tasks = JoinSet::new();
    for item in items {
        let (cluster, tally, shown) = (cluster.clone(), tally.clone(), dest.clone());
        match item {
            UpItem::Dir { .. } => {}
            UpItem::File { local, path } => {
                let (limit, progress) = (limit.clone(), progress.clone());
                tasks.spawn(async move {
                    let _permit = limit.acquire_owned().await;
                    upload_file(&cluster, &shown, &local, &path, config, &progress, &tally).await
                });
            }
            UpItem::Symlink {
                path,
                target,
                mtime,
            } => {
                let entry = symlink_entry(target, mtime);
                tasks.spawn(async move {
                    upload_symlink(&cluster, &shown, &path, &entry, &tally).await
                });
            }
        }
    }
    while tasks.join_next().await.is_some() {}
    Ok(())
}

/// Whether `dest` is an existing directory (the sources go into it) or names the one
/// source's copy; fails if it must be a directory (several sources, a trailing `/`)
/// and is not one.
async fn upload_dest_is_dir(
    cluster: &Cluster,
    sources: usize,
    dest: &ClusterPath,
) -> Result<bool, ClientError> {
    let existing = cluster.meta().entry(&dest.share, &dest.path).await?;
    let dest_is_dir = existing
        .as_ref()
        .is_some_and(|v| v.entry.kind == EntryKind::Dir);
    if !dest_is_dir && (sources > 1 || dest.dir_hint) {
        return Err(remote(
            ErrorKind::NotFound,
            format!("{}: no such directory", dest.display()),
        ));
    }
    Ok(dest_is_dir)
}

/// Plans the upload of every source ([`plan_local`]): the items and their bytes. A
/// source that cannot be planned is recorded as failed, and what is neither a file, a
/// directory nor a symlink as skipped.
fn plan_upload(
    sources: &[PathBuf],
    dest: &ClusterPath,
    dest_is_dir: bool,
    recursive: bool,
    tally: &Tally,
) -> (Vec<UpItem>, u64) {
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
            recursive,
            &mut items,
            &mut total,
            &mut skipped,
        ) {
            tally.fail(src.display().to_string(), e);
        }
    }
    lock(&tally.report).skipped = skipped;
    (items, total)
}

/// Makes the planned directories, in pre-order (parents before children), one at a
/// time, before any file goes into them.
async fn upload_dirs(cluster: &Cluster, items: &[UpItem], dest: &ClusterPath, tally: &Tally) {
    for item in items {
        if let UpItem::Dir { path, mode, mtime } = item {
            match mkdir(cluster, &dest.share, path, &dir_entry(*mode, *mtime)).await {
                Ok(()) => lock(&tally.report).dirs += 1,
                Err(e) => tally.fail(format!("{}/{path}", dest.display()), e),
            }
        }
    }
}

/// Uploads one file to `path` of `dest`'s share, striped over the nodes; the stripes
/// of the file there now that hold the same bytes are reused, not sent.
async fn upload_file(
    cluster: &Cluster,
    dest: &ClusterPath,
    local: &Path,
    path: &str,
    config: ShareConfig,
    progress: &Arc<dyn Progress>,
    tally: &Tally,
) {
    match cluster
        .put_file_reusing(local, (&dest.share, path), config, advance_fn(progress))
        .await
    {
        Ok(p) => tally.put(p),
        Err(e) if e.remote_kind().is_some() => {
            tally.fail(format!("{}/{path}", display_root(dest)), e)
        }
        Err(e) => tally.fail(local.display().to_string(), e),
    }
}

/// Puts the symlink `entry` at `path` of `dest`'s share; the objects of a file it
/// replaces go unless another entry shares them.
async fn upload_symlink(
    cluster: &Cluster,
    dest: &ClusterPath,
    path: &str,
    entry: &Entry,
    tally: &Tally,
) {
    match cluster.commit_entry(&dest.share, path, entry).await {
        Ok(old) => {
            lock(&tally.report).symlinks += 1;
            if let Some(l) = old.and_then(|o| o.layout) {
                cluster.remove_unshared(&dest.share, &l).await;
            }
        }
        Err(e) => tally.fail(format!("{}/{path}", display_root(dest)), e),
    }
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
    let tally = Tally::new();
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
        return tally.take();
    }
    let mut plan = DownPlan::default();
    for src in sources {
        let target = if dest_is_dir {
            dest.join(src.base_name())
        } else {
            dest.to_owned()
        };
        if let Err(e) = plan.add(cluster, src, target, opts.recursive).await {
            tally.fail(src.display(), e);
        }
    }
    progress.set_total(plan.total);
    // Directories in pre-order (keys sort parents first), owner-writable until the end.
    plan.dirs.sort_by(|a, b| a.0.cmp(&b.0));
    for (d, _) in &plan.dirs {
        make_local_dir(d, &tally);
    }
    let limit = Arc::new(Semaphore::new(opts.jobs.max(1)));
    let mut tasks = JoinSet::new();
    for (src, entry, local) in plan.files {
        let (cluster, tally, limit, progress) = (
            cluster.clone(),
            tally.clone(),
            limit.clone(),
            progress.clone(),
        );
        tasks.spawn(async move {
            let _permit = limit.acquire_owned().await;
            match entry.kind {
                EntryKind::Symlink => make_local_symlink(&local, &entry, &tally),
                _ => fetch_file(&cluster, &src, &entry, &local, &progress, &tally).await,
            }
        });
    }
    while tasks.join_next().await.is_some() {}
    // Directory modes and mtimes, deepest first.
    for (d, entry) in plan.dirs.iter().rev() {
        set_local_dir_attrs(d, entry);
    }
    tally.take()
}

/// What a download fetches, planned.
#[derive(Default)]
struct DownPlan {
    /// Files and symlinks: (cluster path, entry, local target).
    files: Vec<(ClusterPath, Entry, PathBuf)>,
    /// Local directories to make, with their entries.
    dirs: Vec<(PathBuf, Entry)>,
    /// The bytes of the files.
    total: u64,
}

impl DownPlan {
    /// Adds `src`, to be written at the local `target`: a file or a symlink, or (with
    /// `recursive`) a directory and its whole subtree, read in one etcd range read.
    async fn add(
        &mut self,
        cluster: &Cluster,
        src: &ClusterPath,
        target: PathBuf,
        recursive: bool,
    ) -> Result<(), ClientError> {
        let root = cluster.meta().existing(&src.share, &src.path).await?.entry;
        match root.kind {
            EntryKind::Dir if !recursive => Err(ClientError::Usage(format!(
                "{}: is a directory (use -r)",
                src.display()
            ))),
            EntryKind::Dir => {
                let below = cluster.meta().below(&src.share, &src.path).await?;
                self.dirs.push((target.clone(), root));
                let strip = below_offset(&src.path);
                for (path, v) in below {
                    let local = target.join(&path[strip..]);
                    match v.entry.kind {
                        EntryKind::Dir => self.dirs.push((local, v.entry)),
                        _ => {
                            self.total += v.entry.size;
                            let cp = ClusterPath {
                                path,
                                dir_hint: false,
                                ..src.clone()
                            };
                            self.files.push((cp, v.entry, local));
                        }
                    }
                }
                Ok(())
            }
            _ => {
                self.total += root.size;
                self.files.push((src.clone(), root, target));
                Ok(())
            }
        }
    }
}

/// Creates the local directory `d` (one already there counts as made).
fn make_local_dir(d: &Path, tally: &Tally) {
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

/// Makes the symlink `entry` at `local` (replacing what is there), with its mtime.
fn make_local_symlink(local: &Path, entry: &Entry, tally: &Tally) {
    let target = entry.target.clone().unwrap_or_default();
    let _ = fs::remove_file(local);
    match std::os::unix::fs::symlink(&target, local) {
        Ok(()) => {
            let t = nix::sys::time::TimeSpec::new(entry.mtime.secs, i64::from(entry.mtime.nanos));
            let _ = nix::sys::stat::utimensat(
                None,
                local,
                &t,
                &t,
                nix::sys::stat::UtimensatFlags::NoFollowSymlink,
            );
            lock(&tally.report).symlinks += 1;
        }
        Err(e) => tally.fail(
            local.display().to_string(),
            ClientError::local(local, "cannot create symlink", e),
        ),
    }
}

/// Fetches the file `src` (its `entry`) into `local`.
async fn fetch_file(
    cluster: &Cluster,
    src: &ClusterPath,
    entry: &Entry,
    local: &Path,
    progress: &Arc<dyn Progress>,
    tally: &Tally,
) {
    match cluster
        .get_file(&src.share, &src.path, entry, local, advance_fn(progress))
        .await
    {
        Ok(c) => tally.copied(c),
        Err(e @ ClientError::Local { .. }) => tally.fail(local.display().to_string(), e),
        Err(e) => tally.fail(src.display(), e),
    }
}

/// Sets a downloaded directory's mode and mtime (after its contents are written).
fn set_local_dir_attrs(d: &Path, entry: &Entry) {
    let _ = fs::set_permissions(d, fs::Permissions::from_mode(entry.mode & 0o7777));
    if entry.mtime != Timestamp::default() {
        if let Ok(f) = fs::File::open(d) {
            let _ = f.set_modified(entry.mtime.to_system());
        }
    }
}
