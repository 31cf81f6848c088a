//! Copying server sources to a local path: `rcp HOST:SHARE/SRC... DST`.

use std::collections::VecDeque;
use std::fs;
use std::os::unix::fs::{symlink, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use ferry_common::attr::set_owner_and_mtime;
use ferry_common::msg::{DirEntry, FileKind, Owner};
use ferry_common::path::valid_name;
use ferry_common::proto::ProtoError;
use ferry_common::staging::link_path;
use rayon::prelude::*;
use tokio::task::JoinSet;

use crate::batch::{self, Outcome, SmallDownload};
use crate::client::Client;
use crate::error::ClientError;
use crate::location::Remote;
use crate::progress::Progress;
use crate::schedule::run_lanes;
use crate::transfer::download_file;

use super::plan::{
    file_lanes, finishing, several_sources_need_a_dir, trailing_slash_needs_a_dir, CopyOptions,
    DirItem, EntryMeta, Plan,
};
use super::report::{finish_report, lock, settle_scheduled, Report, Shared};

/// A download's plan: server sources, local targets.
type DownloadPlan = Plan<Remote, PathBuf>;

/// Copies remote `sources` (all on the server `client` is connected to) to the local
/// path `dest`.
pub async fn download(
    client: &Client,
    sources: &[Remote],
    dest: &Path,
    opts: &CopyOptions,
    progress: Arc<dyn Progress>,
) -> Report {
    let shared = Shared::new(progress);
    let Some(dest_is_dir) = check_dest(dest, sources.len(), &shared) else {
        return finish_report(shared);
    };
    let mut plan = DownloadPlan::default();
    // Like rsync, only a receiver running as root keeps owners.
    let owners = nix::unistd::geteuid().is_root() && client.has_meta();
    for src in sources {
        let target = if dest_is_dir {
            dest.join(src.base_name())
        } else {
            dest.to_owned()
        };
        plan_source(client, src, target, opts, owners, &mut plan, &shared).await;
    }
    shared.progress.set_total(plan.total_bytes());

    let failed = make_dirs(&plan.dirs, &shared);
    let skipped = |t: &Path| failed.iter().any(|f| t.starts_with(f));
    let files = plan.files.into_iter().filter(|(_, t, _)| !skipped(t));
    let (many, big) = tasks(client, files.collect());
    let done = run_lanes(file_lanes(many, big, opts.jobs), |task| {
        let (client, shared) = (client.clone(), shared.clone());
        async move {
            task.run(&client, &shared).await;
            Ok(())
        }
    })
    .await;
    settle_scheduled(&shared, done);
    for (first, to) in plan.links {
        if skipped(&to) {
            continue;
        }
        if !shared.is_done(&first) {
            let why = format!(
                "not linked: its first name {} was not copied",
                first.display()
            );
            shared.fail(to.display().to_string(), ClientError::Usage(why));
            continue;
        }
        match make_local_hard_link(&first, &to) {
            Ok(()) => lock(&shared.report).hard_links += 1,
            Err(e) => shared.fail(
                to.display().to_string(),
                ClientError::local(&to, "cannot create hard link", e),
            ),
        }
    }
    for (link_target, target) in plan.symlinks {
        if skipped(&target) {
            continue;
        }
        match make_local_symlink(&link_target, &target) {
            Ok(()) => shared.linked(&target),
            Err(e) => shared.fail(
                target.display().to_string(),
                ClientError::local(&target, "cannot create symlink", e),
            ),
        }
    }
    set_local_meta(&plan.meta, &plan.dirs, &skipped, &shared);
    if opts.xattrs {
        super::xattrs::download_xattrs(client, &plan.roots, &shared).await;
    }
    set_dir_attrs(&plan.dirs, &skipped, &shared);
    finish_report(shared)
}

/// Gives the copied files and symlinks and the created directories (but the `skipped`
/// ones) their owners (planned only when this process runs as root), and the symlinks
/// their own mtimes, never following a final symlink. Runs once every entry's content
/// is in place and before the directories' modes and mtimes are set.
fn set_local_meta(
    meta: &[EntryMeta<PathBuf>],
    dirs: &[DirItem<PathBuf>],
    skipped: &dyn Fn(&Path) -> bool,
    shared: &Shared,
) {
    let todo = finishing(meta, dirs, |t| shared.is_done(t), |t| !skipped(t));
    // Each entry on its own (a look, and a change only where one is needed), on every
    // core: thousands of them end every large copy.
    todo.par_iter().for_each(|m| {
        let (uid, gid) = (m.owner.map(|o| o.uid), m.owner.map(|o| o.gid));
        if let Err(e) = set_owner_and_mtime(&m.target, uid, gid, m.mtime) {
            let (op, e) = e.into_parts();
            shared.fail(
                m.target.display().to_string(),
                ClientError::local(&m.target, op, e),
            );
        }
    });
}

/// Whether `dest` is a directory, or `None` (the failure recorded) if it cannot take
/// `sources` sources.
fn check_dest(dest: &Path, sources: usize, shared: &Shared) -> Option<bool> {
    let dest_is_dir = fs::metadata(dest).is_ok_and(|m| m.is_dir());
    let shown = dest.display().to_string();
    if dest.as_os_str().as_encoded_bytes().ends_with(b"/") && !dest_is_dir {
        shared.fail(shown.clone(), trailing_slash_needs_a_dir(shown));
        return None;
    }
    if sources > 1 && !dest_is_dir {
        shared.fail(shown.clone(), several_sources_need_a_dir(shown));
        return None;
    }
    Some(dest_is_dir)
}

/// Adds the server source `src` to `plan` as `target` (a tree whole), or records why
/// not.
async fn plan_source(
    client: &Client,
    src: &Remote,
    target: PathBuf,
    opts: &CopyOptions,
    owners: bool,
    plan: &mut DownloadPlan,
    shared: &Shared,
) {
    let attr = match client.stat(&src.share, &src.path, true).await {
        Ok(a) => a,
        Err(e) => return shared.fail(src.display(), e),
    };
    match attr.kind {
        FileKind::Dir if !opts.recursive => shared.fail(
            src.display(),
            ClientError::Usage(format!("{}: is a directory (use -r)", src.display())),
        ),
        FileKind::Dir => {
            plan.roots.push((src.clone(), target.clone()));
            let root = DirItem {
                target,
                mode: attr.mode,
                mtime: attr.mtime,
                owner: None,
            };
            walk_remote(client, src, root, (owners, opts.hard_links), plan, shared).await;
        }
        FileKind::File => {
            plan.roots.push((src.clone(), target.clone()));
            plan.files.push((src.clone(), target, attr.size))
        }
        _ => shared.fail(
            src.display(),
            ClientError::Usage(format!(
                "{}: not a regular file or directory",
                src.display()
            )),
        ),
    }
}

/// Walks the remote directory `root` breadth-first, adding it (as `item`) and
/// everything below it to `plan`. A directory that cannot be listed is reported and not
/// created locally (an empty copy would pass for a complete one); breadth-first order
/// keeps every directory after its parent. With `owners`, the listings carry every
/// entry's owner (`ListDirMeta`), planned to be kept; with `hard_links` (`-H`), further
/// names of a file (same server inode) are planned as links to its first.
///
/// Up to [`LISTINGS_AT_ONCE`] listings are in flight all the time (a directory is
/// listed as soon as its parent's listing names it, not a wave at a time), and the
/// listings are then taken into the plan in the order a listing at a time would take
/// them: by depth, then by path, name by name.
async fn walk_remote(
    client: &Client,
    root: &Remote,
    item: DirItem<PathBuf>,
    (owners, hard_links): (bool, bool),
    plan: &mut DownloadPlan,
    shared: &Shared,
) {
    let mut pending = VecDeque::from([(root.clone(), item)]);
    let mut running = JoinSet::new();
    let mut listed = Vec::new();
    loop {
        while running.len() < LISTINGS_AT_ONCE {
            let Some((dir, item)) = pending.pop_front() else {
                break;
            };
            let client = client.clone();
            running.spawn(async move {
                let listing = list(&client, &dir, owners).await;
                (dir, item, listing)
            });
        }
        let Some(joined) = running.join_next().await else {
            break;
        };
        let (dir, item, listing) = match joined {
            Ok(l) => l,
            Err(e) => {
                let e = ClientError::Disconnected(format!("a listing task failed: {e}"));
                return shared.fail(root.display(), e);
            }
        };
        if let Ok((_, entries)) = &listing {
            for (entry, _) in entries {
                if let Some(sub) = subdir(&dir, &item, entry) {
                    pending.push_back(sub);
                }
            }
        }
        listed.push((dir, item, listing));
    }
    listed.sort_by_cached_key(|(dir, ..)| {
        let names: Vec<String> = dir.path.split('/').map(str::to_owned).collect();
        (names.len(), names)
    });
    for (dir, item, listing) in listed {
        walk_listed(dir, item, listing, hard_links, plan, shared);
    }
}

/// The directory `entry` of the listed `dir` (planned as `item`), to be listed and
/// planned in turn; `None` for another kind of entry, or an invalid name (which
/// [`walk_listed`] reports).
fn subdir(
    dir: &Remote,
    item: &DirItem<PathBuf>,
    entry: &DirEntry,
) -> Option<(Remote, DirItem<PathBuf>)> {
    if entry.attr.kind != FileKind::Dir || !valid_name(&entry.name) {
        return None;
    }
    let sub = DirItem {
        target: item.target.join(&entry.name),
        mode: entry.attr.mode,
        mtime: entry.attr.mtime,
        owner: None,
    };
    Some((dir.join(&entry.name), sub))
}

/// Directories a download lists at once while it walks the server's tree.
const LISTINGS_AT_ONCE: usize = 32;

/// Adds the listed directory `dir` (planned as `item`) and its files and symlinks to
/// `plan` (its subdirectories come with their own listings).
fn walk_listed(
    dir: Remote,
    mut item: DirItem<PathBuf>,
    listing: Result<Listing, ClientError>,
    hard_links: bool,
    plan: &mut DownloadPlan,
    shared: &Shared,
) {
    let entries = match listing {
        Ok((owner, entries)) => {
            item.owner = owner;
            entries
        }
        Err(e) => {
            return shared.fail(dir.display(), e);
        }
    };
    let local = item.target.clone();
    plan.dirs.push(item);
    for (entry, owner) in entries {
        let name = entry.name.as_str();
        if !valid_name(name) {
            let why = format!("server listed an invalid name {name:?}");
            shared.fail(
                dir.display(),
                ClientError::Protocol(ProtoError::Transfer(why)),
            );
            continue;
        }
        let child = dir.join(name);
        let child_local = local.join(name);
        match entry.attr.kind {
            FileKind::Dir => {}
            FileKind::File => {
                let id = (
                    (entry.attr.dev, entry.attr.ino),
                    u64::from(entry.attr.nlink),
                );
                let size = entry.attr.size;
                if plan.add_file(child, child_local.clone(), size, id, hard_links)
                    && owner.is_some()
                {
                    plan.meta.push(EntryMeta {
                        target: child_local,
                        owner,
                        mtime: None,
                    });
                }
            }
            FileKind::Symlink => match entry.attr.symlink_target {
                Some(t) => {
                    plan.meta.push(EntryMeta {
                        target: child_local.clone(),
                        owner,
                        mtime: Some(entry.attr.mtime),
                    });
                    plan.symlinks.push((t, child_local));
                }
                None => shared.fail(
                    child.display(),
                    ClientError::Usage("symlink without target".into()),
                ),
            },
            FileKind::Other | FileKind::Node { .. } => {
                lock(&shared.report).skipped.push(child.display());
            }
        }
    }
}

/// Every entry of the directory `dir`, with its owner and the directory's own when
/// `owners` (one `ListDirMeta` listing), else without (`ListDir`).
/// A directory's listing: its own owner and its entries with theirs (with owners).
type Listing = (Option<Owner>, Vec<(DirEntry, Option<Owner>)>);

async fn list(client: &Client, dir: &Remote, owners: bool) -> Result<Listing, ClientError> {
    if owners {
        let (owner, entries) = client.list_dir_meta(&dir.share, &dir.path).await?;
        let entries = entries.into_iter().map(|(e, o)| (e, Some(o))).collect();
        Ok((Some(owner), entries))
    } else {
        let entries = client.list_dir(&dir.share, &dir.path).await?;
        Ok((None, entries.into_iter().map(|e| (e, None)).collect()))
    }
}

/// Creates the planned directories, parents first, owner-writable until the end.
/// Returns the ones that failed; nothing is attempted below one (one error, and a
/// conflicting local file is left alone).
fn make_dirs(dirs: &[DirItem<PathBuf>], shared: &Shared) -> Vec<PathBuf> {
    let mut failed: Vec<PathBuf> = Vec::new();
    for d in dirs {
        if failed.iter().any(|f| d.target.starts_with(f)) {
            continue;
        }
        let r = match fs::create_dir(&d.target) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists && d.target.is_dir() => Ok(()),
            Err(e) => Err(e),
        }
        .and_then(|()| {
            let m = fs::metadata(&d.target)?.mode();
            fs::set_permissions(&d.target, fs::Permissions::from_mode((m & 0o7777) | 0o700))
        });
        match r {
            Ok(()) => lock(&shared.report).dirs += 1,
            Err(e) => {
                shared.fail(
                    d.target.display().to_string(),
                    ClientError::local(&d.target, "cannot create directory", e),
                );
                failed.push(d.target.clone());
            }
        }
    }
    failed
}

/// Gives the planned directories (but the `skipped` ones) their modes and mtimes,
/// children first.
fn set_dir_attrs(dirs: &[DirItem<PathBuf>], skipped: &dyn Fn(&Path) -> bool, shared: &Shared) {
    for d in dirs.iter().rev() {
        if skipped(&d.target) {
            continue;
        }
        let r = fs::set_permissions(&d.target, fs::Permissions::from_mode(d.mode & 0o7777))
            .and_then(|()| fs::File::open(&d.target)?.set_modified(d.mtime.to_system()));
        if let Err(e) = r {
            shared.fail(
                d.target.display().to_string(),
                ClientError::local(&d.target, "cannot set attributes", e),
            );
        }
    }
}

/// One task of a download.
enum Task {
    /// Small files of one share in one `DownloadBatch`: the share's root, the files.
    Batch(Remote, Vec<SmallDownload>),
    /// One file on the per-file path: source, target.
    File(Remote, PathBuf),
}

/// The tasks for `files` (source, target, size): batches of small ones and the files
/// of one chunk or less, then the bigger files with their sizes (see [`file_lanes`]).
fn tasks(client: &Client, files: Vec<(Remote, PathBuf, u64)>) -> (Vec<Task>, Vec<(Task, u64)>) {
    let (small, others): (Vec<_>, Vec<_>) = files
        .into_iter()
        .partition(|(_, _, size)| batch::is_small(client, *size));
    // A batch names paths of one share: the sources' shares, in order of appearance.
    let mut by_share: Vec<(Remote, Vec<SmallDownload>)> = Vec::new();
    for (src, target, size) in small {
        let item = SmallDownload {
            src: src.path.clone(),
            target,
            size,
        };
        match by_share.iter_mut().find(|(r, _)| r.share == src.share) {
            Some((_, items)) => items.push(item),
            None => by_share.push((src, vec![item])),
        }
    }
    let chunk = u64::from(client.welcome().chunk_bytes);
    let (medium, big): (Vec<_>, Vec<_>) =
        others.into_iter().partition(|(_, _, size)| *size <= chunk);
    let mut many: Vec<Task> = medium
        .into_iter()
        .map(|(src, target, _)| Task::File(src, target))
        .collect();
    let capacity = batch::capacity(client);
    for (root, items) in by_share {
        let batches = batch::pack(items, capacity, |i| i.size, |i| i.src.len());
        many.extend(batches.into_iter().map(|b| Task::Batch(root.clone(), b)));
    }
    let big = big
        .into_iter()
        .map(|(src, target, size)| (Task::File(src, target), size))
        .collect();
    (many, big)
}

impl Task {
    /// Does the task and records its outcome.
    async fn run(self, client: &Client, shared: &Arc<Shared>) {
        match self {
            Task::Batch(root, items) => {
                let progress = shared.progress_fn();
                for (item, outcome) in
                    batch::download_batch(client, &root.share, items, &progress).await
                {
                    let src = root.with_path(item.src);
                    match outcome {
                        Outcome::Copied(c) => shared.copied(&item.target, c),
                        Outcome::Failed(e) => shared.download_failed(&src, &item.target, e),
                        Outcome::PerFile => download_one(client, shared, src, item.target).await,
                    }
                }
            }
            Task::File(src, target) => download_one(client, shared, src, target).await,
        }
    }
}

/// Downloads one file on the per-file path and records the outcome.
async fn download_one(client: &Client, shared: &Arc<Shared>, src: Remote, target: PathBuf) {
    let progress = shared.progress_fn();
    match download_file(client, &src.share, &src.path, &target, progress).await {
        Ok(c) => shared.copied(&target, c),
        Err(e) => shared.download_failed(&src, &target, e),
    }
}

/// Makes `to` a hard link to the file `first` (`-H`), atomically replacing what `to`
/// held, through the same hidden name a symlink is made under.
fn make_local_hard_link(first: &Path, to: &Path) -> std::io::Result<()> {
    let inode = |m: fs::Metadata| (m.dev(), m.ino());
    // Already one (rename(2) of two names of one inode would do nothing and leave the
    // hidden name behind).
    if fs::symlink_metadata(to).ok().map(inode) == Some(inode(fs::symlink_metadata(first)?)) {
        return Ok(());
    }
    let tmp = link_path(to).ok_or_else(|| std::io::Error::other("no file name"))?;
    match fs::hard_link(first, &tmp) {
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
            fs::remove_file(&tmp)?;
            fs::hard_link(first, &tmp)?;
        }
        made => made?,
    }
    fs::rename(&tmp, to).inspect_err(|_| {
        let _ = fs::remove_file(&tmp);
    })
}

/// Creates `link` -> `target`, atomically replacing a file or link already there. The
/// link is made under a hidden name derived from `link`'s, so one that a killed copy
/// left there is replaced rather than left behind.
fn make_local_symlink(target: &str, link: &Path) -> std::io::Result<()> {
    let tmp = link_path(link).ok_or_else(|| std::io::Error::other("no file name"))?;
    match symlink(target, &tmp) {
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
            fs::remove_file(&tmp)?;
            symlink(target, &tmp)?;
        }
        made => made?,
    }
    fs::rename(&tmp, link).inspect_err(|_| {
        let _ = fs::remove_file(&tmp);
    })
}
