//! `rcp`'s copy jobs: cp/scp semantics for files and trees, in both directions.
//!
//! A copy is planned first (every source resolved, trees walked), then executed:
//! directories are created (owner-writable) in pre-order, files and symlinks are copied
//! with at most `jobs` files (or batches of small files, see [`crate::batch`]) in
//! flight, and finally directory modes and mtimes are set deepest first, so that
//! creating children does not disturb a parent's mtime.
//! A failing item is recorded and the rest of the copy goes on.

use std::fs;
use std::os::unix::fs::{symlink, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use ferry_common::attr::attr_of;
use ferry_common::msg::{ErrorKind, FileKind, Timestamp};
use ferry_common::staging::link_path;
use tokio::sync::Semaphore;
use tokio::task::JoinSet;

use crate::batch::{self, Outcome, SmallDownload, SmallUpload};
use crate::client::Client;
use crate::error::ClientError;
use crate::location::Remote;
use crate::transfer::{download_file, upload_file, Copied, ProgressFn};

/// Options of a copy.
#[derive(Debug, Clone)]
pub struct CopyOptions {
    /// Copy directories.
    pub recursive: bool,
    /// Files in flight at once.
    pub jobs: usize,
}

/// One failed item.
#[derive(Debug)]
pub struct ItemError {
    /// The item, as the user would name it.
    pub path: String,
    /// What went wrong.
    pub error: ClientError,
}

/// What a copy did.
#[derive(Debug, Default)]
pub struct Report {
    /// Regular files copied.
    pub files: u64,
    /// Directories created or reused.
    pub dirs: u64,
    /// Symlinks copied.
    pub symlinks: u64,
    /// File bytes copied (the sizes of the files copied).
    pub bytes: u64,
    /// File bytes of the files copied that crossed the connection: pulled by the server
    /// (uploads) or pushed by it (downloads).
    pub bytes_sent: u64,
    /// File bytes of the files copied that were not sent because an interrupted copy
    /// had left them, verified, in the destination's partial file (`bytes_sent +
    /// bytes_reused == bytes`).
    pub bytes_reused: u64,
    /// Items that failed.
    pub errors: Vec<ItemError>,
    /// Special files (devices, fifos, sockets) inside trees, not copied (as rsync does
    /// without `-D`).
    pub skipped: Vec<String>,
}

/// Progress callbacks of a copy.
pub trait Progress: Send + Sync {
    /// The total number of file bytes, once planned.
    fn set_total(&self, bytes: u64);
    /// `bytes` more were copied.
    fn advance(&self, bytes: u64);
}

/// A transfer's progress function that advances `progress`.
pub(crate) fn advance_fn(progress: &Arc<dyn Progress>) -> ProgressFn {
    let progress = progress.clone();
    Arc::new(move |n| progress.advance(n))
}

/// A directory to create, with the attributes to give it at the end.
struct DirItem<T> {
    target: T,
    mode: u32,
    mtime: Timestamp,
}

/// A planned copy from `S` (source) to `T` (target).
struct Plan<S, T> {
    dirs: Vec<DirItem<T>>,
    files: Vec<(S, T, u64)>,
    symlinks: Vec<(String, T)>,
}

impl<S, T> Default for Plan<S, T> {
    fn default() -> Self {
        Plan {
            dirs: Vec::new(),
            files: Vec::new(),
            symlinks: Vec::new(),
        }
    }
}

impl<S, T> Plan<S, T> {
    fn total_bytes(&self) -> u64 {
        self.files.iter().map(|(_, _, n)| n).sum()
    }
}

struct Shared {
    report: Mutex<Report>,
    progress: Arc<dyn Progress>,
}

impl Shared {
    fn new(progress: Arc<dyn Progress>) -> Arc<Shared> {
        Arc::new(Shared {
            report: Mutex::new(Report::default()),
            progress,
        })
    }

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

    /// Records a failed upload: server errors are about the target, local ones about
    /// the source.
    fn upload_failed(&self, dest: &Remote, src: &Path, target: &str, e: ClientError) {
        if e.remote_kind().is_some() {
            self.fail(dest.with_path(target.to_string()).display(), e);
        } else {
            self.fail(src.display().to_string(), e);
        }
    }

    /// Records a failed download: local errors are about the target (a full disk, a
    /// directory we may not write), the others about the source.
    fn download_failed(&self, src: &Remote, target: &Path, e: ClientError) {
        match e {
            ClientError::Local { .. } => self.fail(target.display().to_string(), e),
            e => self.fail(src.display(), e),
        }
    }

    fn progress_fn(self: &Arc<Self>) -> ProgressFn {
        let shared = self.clone();
        Arc::new(move |n| shared.progress.advance(n))
    }
}

/// Spawns `job` onto `tasks`; it starts running once `slots` has a permit, so at most
/// as many jobs as the semaphore has permits run at once.
fn spawn_limited<F>(tasks: &mut JoinSet<()>, slots: &Arc<Semaphore>, job: F)
where
    F: std::future::Future<Output = ()> + Send + 'static,
{
    let slots = slots.clone();
    tasks.spawn(async move {
        let _permit = slots.acquire_owned().await;
        job.await
    });
}

fn trailing_slash_needs_a_dir(shown: String) -> ClientError {
    ClientError::Usage(format!(
        "{shown}: not a directory (a trailing '/' names an existing directory)"
    ))
}

fn several_sources_need_a_dir(shown: String) -> ClientError {
    ClientError::Usage(format!(
        "{shown}: target is not a directory (needed for several sources)"
    ))
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn base_name(p: &Path) -> Option<String> {
    p.file_name().map(|n| n.to_string_lossy().into_owned())
}

// ---------------------------------------------------------------- upload

/// Copies local `sources` to `dest` on the server `client` is connected to.
pub async fn upload(
    client: &Client,
    sources: &[PathBuf],
    dest: &Remote,
    opts: &CopyOptions,
    progress: Arc<dyn Progress>,
) -> Report {
    let shared = Shared::new(progress);
    let dest_is_dir = match client.stat(&dest.share, &dest.path, true).await {
        Ok(a) => a.kind == FileKind::Dir,
        Err(e) if e.remote_kind() == Some(ErrorKind::NotFound) => false,
        Err(e) => {
            shared.fail(dest.display(), e);
            return finish_report(shared);
        }
    };
    if dest.dir_hint && !dest_is_dir {
        shared.fail(dest.display(), trailing_slash_needs_a_dir(dest.display()));
        return finish_report(shared);
    }
    if sources.len() > 1 && !dest_is_dir {
        shared.fail(dest.display(), several_sources_need_a_dir(dest.display()));
        return finish_report(shared);
    }
    let mut plan: Plan<PathBuf, String> = Plan::default();
    for src in sources {
        let target = if dest_is_dir {
            match base_name(src) {
                Some(n) => dest.join(&n).path,
                // `.`, `..`, `/`: like cp, copy the contents into the directory.
                None if fs::metadata(src).is_ok_and(|m| m.is_dir()) => dest.path.clone(),
                None => {
                    shared.fail(
                        src.display().to_string(),
                        ClientError::Usage(format!(
                            "{}: cannot copy a path without a name",
                            src.display()
                        )),
                    );
                    continue;
                }
            }
        } else {
            dest.path.clone()
        };
        // Command-line sources are followed, like cp and scp do.
        let meta = match fs::metadata(src) {
            Ok(m) => m,
            Err(e) => {
                shared.fail(
                    src.display().to_string(),
                    ClientError::local(src, "cannot stat", e),
                );
                continue;
            }
        };
        if meta.is_dir() {
            if !opts.recursive {
                shared.fail(
                    src.display().to_string(),
                    ClientError::Usage(format!("{}: is a directory (use -r)", src.display())),
                );
                continue;
            }
            walk_local(src, target, &meta, &mut plan, &shared);
        } else if meta.is_file() {
            plan.files.push((src.clone(), target, meta.len()));
        } else {
            shared.fail(
                src.display().to_string(),
                ClientError::local(
                    src,
                    "cannot copy",
                    std::io::Error::other("not a regular file or directory"),
                ),
            );
        }
    }
    shared.progress.set_total(plan.total_bytes());

    let failed = upload_dirs(client, dest, &plan.dirs, &shared).await;
    let skipped = |t: &str| under_any(&failed, t);
    let sem = Arc::new(Semaphore::new(opts.jobs.max(1)));
    let mut tasks = JoinSet::new();
    let (small, large): (Vec<_>, Vec<_>) = plan
        .files
        .into_iter()
        .filter(|(_, target, _)| !skipped(target))
        .partition(|(_, _, size)| batch::is_small(client, *size));
    let small = small
        .into_iter()
        .map(|(src, target, size)| SmallUpload { src, target, size })
        .collect();
    for items in batch::pack(
        small,
        batch::capacity(client),
        |i| i.size,
        |i| i.target.len(),
    ) {
        let (client, shared, dest) = (client.clone(), shared.clone(), dest.clone());
        spawn_limited(&mut tasks, &sem, async move {
            let progress = shared.progress_fn();
            for (item, outcome) in batch::upload_batch(&client, &dest.share, items, &progress).await
            {
                match outcome {
                    Outcome::Copied(c) => shared.copied(c),
                    Outcome::Failed(e) => shared.upload_failed(&dest, &item.src, &item.target, e),
                    Outcome::PerFile => {
                        upload_one(&client, &shared, &dest, item.src, item.target).await
                    }
                }
            }
        });
    }
    for (src, target, _) in large {
        let (client, shared, dest) = (client.clone(), shared.clone(), dest.clone());
        spawn_limited(&mut tasks, &sem, async move {
            upload_one(&client, &shared, &dest, src, target).await
        });
    }
    for (link_target, target) in plan.symlinks {
        if skipped(&target) {
            continue;
        }
        let (client, shared, share) = (client.clone(), shared.clone(), dest.share.clone());
        let shown = dest.with_path(target.clone()).display();
        tasks.spawn(async move {
            match client.symlink(&share, &target, &link_target).await {
                Ok(()) => lock(&shared.report).symlinks += 1,
                Err(e) => shared.fail(shown, e),
            }
        });
    }
    while tasks.join_next().await.is_some() {}
    for d in plan.dirs.iter().rev() {
        if failed.contains(&d.target) || skipped(&d.target) {
            continue;
        }
        if let Err(e) = client
            .set_attr(&dest.share, &d.target, Some(d.mode), Some(d.mtime))
            .await
        {
            shared.fail(dest.with_path(d.target.clone()).display(), e);
        }
    }
    finish_report(shared)
}

/// Uploads one file on the per-file path and records the outcome.
async fn upload_one(
    client: &Client,
    shared: &Arc<Shared>,
    dest: &Remote,
    src: PathBuf,
    target: String,
) {
    match upload_file(client, &src, &dest.share, &target, shared.progress_fn()).await {
        Ok(c) => shared.copied(c),
        Err(e) => shared.upload_failed(dest, &src, &target, e),
    }
}

/// Downloads one file on the per-file path and records the outcome.
async fn download_one(client: &Client, shared: &Arc<Shared>, src: Remote, target: PathBuf) {
    let progress = shared.progress_fn();
    match download_file(client, &src.share, &src.path, &target, progress).await {
        Ok(c) => shared.copied(c),
        Err(e) => shared.download_failed(&src, &target, e),
    }
}

/// Creates the planned directories, parents first, owner-writable until the end.
/// Returns the ones that failed; nothing below them is attempted (one error, not one
/// per entry).
async fn upload_dirs(
    client: &Client,
    dest: &Remote,
    dirs: &[DirItem<String>],
    shared: &Shared,
) -> Vec<String> {
    let mut failed: Vec<String> = Vec::new();
    for d in dirs {
        if under_any(&failed, &d.target) {
            continue;
        }
        match client
            .mkdir(&dest.share, &d.target, d.mode | 0o700, true)
            .await
        {
            Ok(()) => lock(&shared.report).dirs += 1,
            Err(e) => {
                shared.fail(dest.with_path(d.target.clone()).display(), e);
                failed.push(d.target.clone());
            }
        }
    }
    failed
}

/// True if `path` lies strictly below one of `dirs` (share-relative paths).
fn under_any(dirs: &[String], path: &str) -> bool {
    dirs.iter().any(|d| {
        path.len() > d.len() && path.starts_with(d.as_str()) && path.as_bytes()[d.len()] == b'/'
    })
}

fn join_rel(base: &str, name: &str) -> String {
    if base.is_empty() {
        name.to_string()
    } else {
        format!("{base}/{name}")
    }
}

fn walk_local(
    src: &Path,
    target: String,
    meta: &fs::Metadata,
    plan: &mut Plan<PathBuf, String>,
    shared: &Shared,
) {
    // A directory that cannot be listed is reported and not created on the server (an
    // empty copy would pass for a complete one).
    let entries = match fs::read_dir(src) {
        Ok(e) => e,
        Err(e) => {
            shared.fail(
                src.display().to_string(),
                ClientError::local(src, "cannot list", e),
            );
            return;
        }
    };
    let attr = attr_of(meta, None);
    plan.dirs.push(DirItem {
        target: target.clone(),
        mode: attr.mode,
        mtime: attr.mtime,
    });
    let mut children: Vec<_> = entries.filter_map(|e| e.ok()).collect();
    children.sort_by_key(|e| e.file_name());
    for entry in children {
        let path = entry.path();
        let Some(name) = entry.file_name().to_str().map(str::to_owned) else {
            shared.fail(
                path.display().to_string(),
                ClientError::local(
                    &path,
                    "cannot copy",
                    std::io::Error::other("name is not UTF-8"),
                ),
            );
            continue;
        };
        let child_target = join_rel(&target, &name);
        let meta = match fs::symlink_metadata(&path) {
            Ok(m) => m,
            Err(e) => {
                shared.fail(
                    path.display().to_string(),
                    ClientError::local(&path, "cannot stat", e),
                );
                continue;
            }
        };
        let t = meta.file_type();
        if t.is_dir() {
            walk_local(&path, child_target, &meta, plan, shared);
        } else if t.is_file() {
            plan.files.push((path, child_target, meta.len()));
        } else if t.is_symlink() {
            match fs::read_link(&path) {
                Ok(l) => plan
                    .symlinks
                    .push((l.to_string_lossy().into_owned(), child_target)),
                Err(e) => shared.fail(
                    path.display().to_string(),
                    ClientError::local(&path, "cannot read link", e),
                ),
            }
        } else {
            lock(&shared.report)
                .skipped
                .push(path.display().to_string());
        }
    }
}

// ---------------------------------------------------------------- download

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
    let dest_is_dir = fs::metadata(dest).is_ok_and(|m| m.is_dir());
    if dest.as_os_str().as_encoded_bytes().ends_with(b"/") && !dest_is_dir {
        let shown = dest.display().to_string();
        shared.fail(shown.clone(), trailing_slash_needs_a_dir(shown));
        return finish_report(shared);
    }
    if sources.len() > 1 && !dest_is_dir {
        let shown = dest.display().to_string();
        shared.fail(shown.clone(), several_sources_need_a_dir(shown));
        return finish_report(shared);
    }
    let mut plan: Plan<Remote, PathBuf> = Plan::default();
    for src in sources {
        let target = if dest_is_dir {
            dest.join(src.base_name())
        } else {
            dest.to_owned()
        };
        let attr = match client.stat(&src.share, &src.path, true).await {
            Ok(a) => a,
            Err(e) => {
                shared.fail(src.display(), e);
                continue;
            }
        };
        match attr.kind {
            FileKind::Dir if !opts.recursive => shared.fail(
                src.display(),
                ClientError::Usage(format!("{}: is a directory (use -r)", src.display())),
            ),
            FileKind::Dir => {
                let root = DirItem {
                    target,
                    mode: attr.mode,
                    mtime: attr.mtime,
                };
                walk_remote(client, src, root, &mut plan, &shared).await;
            }
            FileKind::File => plan.files.push((src.clone(), target, attr.size)),
            _ => shared.fail(
                src.display(),
                ClientError::Usage(format!(
                    "{}: not a regular file or directory",
                    src.display()
                )),
            ),
        }
    }
    shared.progress.set_total(plan.total_bytes());

    // Directories, parents first, owner-writable until the end. Nothing is attempted
    // below one that failed (one error, and a conflicting local file is left alone).
    let mut failed: Vec<PathBuf> = Vec::new();
    for d in &plan.dirs {
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
    let skipped = |t: &Path| failed.iter().any(|f| t.starts_with(f));
    let sem = Arc::new(Semaphore::new(opts.jobs.max(1)));
    let mut tasks = JoinSet::new();
    let (small, large): (Vec<_>, Vec<_>) = plan
        .files
        .into_iter()
        .filter(|(_, target, _)| !skipped(target))
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
    for (root, items) in by_share {
        for items in batch::pack(items, batch::capacity(client), |i| i.size, |i| i.src.len()) {
            let (client, shared, root) = (client.clone(), shared.clone(), root.clone());
            spawn_limited(&mut tasks, &sem, async move {
                let progress = shared.progress_fn();
                let share = root.share.clone();
                for (item, outcome) in
                    batch::download_batch(&client, &share, items, &progress).await
                {
                    let src = root.with_path(item.src);
                    match outcome {
                        Outcome::Copied(c) => shared.copied(c),
                        Outcome::Failed(e) => shared.download_failed(&src, &item.target, e),
                        Outcome::PerFile => download_one(&client, &shared, src, item.target).await,
                    }
                }
            });
        }
    }
    for (src, target, _) in large {
        let (client, shared) = (client.clone(), shared.clone());
        spawn_limited(&mut tasks, &sem, async move {
            download_one(&client, &shared, src, target).await
        });
    }
    while tasks.join_next().await.is_some() {}
    for (link_target, target) in plan.symlinks {
        if skipped(&target) {
            continue;
        }
        match make_local_symlink(&link_target, &target) {
            Ok(()) => lock(&shared.report).symlinks += 1,
            Err(e) => shared.fail(
                target.display().to_string(),
                ClientError::local(&target, "cannot create symlink", e),
            ),
        }
    }
    for d in plan.dirs.iter().rev() {
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
    finish_report(shared)
}

/// Walks the remote directory `root` breadth-first, adding it (as `item`) and
/// everything below it to `plan`. A directory that cannot be listed is reported and not
/// created locally (an empty copy would pass for a complete one); breadth-first order
/// keeps every directory after its parent.
async fn walk_remote(
    client: &Client,
    root: &Remote,
    item: DirItem<PathBuf>,
    plan: &mut Plan<Remote, PathBuf>,
    shared: &Shared,
) {
    let mut queue = std::collections::VecDeque::from([(root.clone(), item)]);
    while let Some((dir, item)) = queue.pop_front() {
        let entries = match client.list_dir(&dir.share, &dir.path).await {
            Ok(e) => e,
            Err(e) => {
                shared.fail(dir.display(), e);
                continue;
            }
        };
        let local = item.target.clone();
        plan.dirs.push(item);
        for entry in entries {
            if entry.name.contains('/')
                || entry.name == ".."
                || entry.name == "."
                || entry.name.is_empty()
            {
                shared.fail(
                    dir.display(),
                    ClientError::Protocol(ferry_common::proto::ProtoError::Transfer(format!(
                        "server listed an invalid name {:?}",
                        entry.name
                    ))),
                );
                continue;
            }
            let child = dir.join(&entry.name);
            let child_local = local.join(&entry.name);
            match entry.attr.kind {
                FileKind::Dir => {
                    let item = DirItem {
                        target: child_local,
                        mode: entry.attr.mode,
                        mtime: entry.attr.mtime,
                    };
                    queue.push_back((child, item));
                }
                FileKind::File => plan.files.push((child, child_local, entry.attr.size)),
                FileKind::Symlink => match entry.attr.symlink_target {
                    Some(t) => plan.symlinks.push((t, child_local)),
                    None => shared.fail(
                        child.display(),
                        ClientError::Usage("symlink without target".into()),
                    ),
                },
                FileKind::Other => {
                    lock(&shared.report).skipped.push(child.display());
                }
            }
        }
    }
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

fn finish_report(shared: Arc<Shared>) -> Report {
    std::mem::take(&mut *lock(&shared.report))
}
