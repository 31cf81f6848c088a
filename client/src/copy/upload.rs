//! Copying local sources to the server: `rcp SRC... HOST:SHARE/DST`.

use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use ferry_common::attr::owner_of;
use ferry_common::msg::{
    AttrEntry, ErrorKind, FileKind, MetaEntry, NewDir, RemoteError, LINK_BATCH_MAX,
};

use crate::batch::{self, Outcome, SmallUpload, DIR_BATCHES_AT_ONCE};
use crate::client::Client;
use crate::error::ClientError;
use crate::filter::Filter;
use crate::links::pack_links;
use crate::location::Remote;
use crate::progress::Progress;
use crate::schedule::{run_lanes, UNLIMITED};
use crate::transfer::upload_file;
use crate::walk::{join, walk, Problem};

use super::gate::{depth, under_any, DirGate};
use super::plan::{
    file_lanes, finishing, several_sources_need_a_dir, trailing_slash_needs_a_dir, CopyOptions,
    DirItem, EntryMeta, Plan,
};
use super::report::{finish_report, lock, settle_scheduled, Report, Shared};

/// An upload's plan: local sources, share-relative targets.
type UploadPlan = Plan<PathBuf, String>;

/// Copies local `sources` to `dest` on the server `client` is connected to.
pub async fn upload(
    client: &Client,
    sources: &[PathBuf],
    dest: &Remote,
    opts: &CopyOptions,
    progress: Arc<dyn Progress>,
) -> Report {
    let shared = Shared::new(progress);
    let Some(dest_is_dir) = check_dest(client, dest, sources.len(), &shared).await else {
        return finish_report(shared);
    };
    let mut plan = UploadPlan::default();
    for src in sources {
        plan_source(src, dest, dest_is_dir, opts, &mut plan, &shared);
    }
    shared.progress.set_total(plan.total_bytes());

    // Files start as soon as their own directory exists, while deeper levels of the
    // tree are still being made (each waits at the gate for its level).
    let gate = Arc::new(DirGate::new(plan.dirs.iter().map(|d| d.target.as_str())));
    let tasks = tasks(client, plan.files, plan.symlinks);
    let copying = run_lanes(tasks.lanes(opts.jobs), |task| {
        let (client, shared, dest) = (client.clone(), shared.clone(), dest.clone());
        let gate = gate.clone();
        async move {
            if let Some(task) = task.admit(&gate).await {
                task.run(&client, &shared, &dest).await;
            }
            Ok(())
        }
    });
    let ((), done) = tokio::join!(
        upload_dirs(client, dest, &plan.dirs, &shared, &gate),
        copying
    );
    settle_scheduled(&shared, done);
    let failed = gate.failed();
    let skipped = |t: &str| under_any(&failed, t);
    let links = plan
        .links
        .into_iter()
        .filter(|(_, t)| !skipped(t))
        .collect();
    upload_links(client, dest, links, &shared).await;
    let dir_failed = |t: &str| failed.iter().any(|f| f == t) || skipped(t);
    if client.has_meta() {
        // With directory batches, a directory's owner is set with its mode and mtime.
        let dirs: &[DirItem<String>] = if client.has_dirs() { &[] } else { &plan.dirs };
        upload_meta(client, dest, &plan.meta, dirs, &dir_failed, &shared).await;
    }
    if opts.xattrs {
        super::xattrs::upload_xattrs(client, dest, &plan.roots, &shared).await;
    }
    finish_dirs(client, dest, &plan.dirs, &dir_failed, &shared).await;
    finish_report(shared)
}

// `upload_meta` packs its batches with `batch::pack`, which counts to BATCH_MAX_FILES.
const _: () = assert!(ferry_common::msg::META_BATCH_MAX == ferry_common::msg::BATCH_MAX_FILES);

/// Gives the copied files and symlinks and the created directories (but the
/// `dir_failed` ones) their owners, and the symlinks their own mtimes, in batches of
/// `SetMeta` (owners are applied only by a server running as root). Runs once every
/// entry's content is in place and before the directories' modes and mtimes are set.
async fn upload_meta(
    client: &Client,
    dest: &Remote,
    meta: &[EntryMeta<String>],
    dirs: &[DirItem<String>],
    dir_failed: &dyn Fn(&str) -> bool,
    shared: &Shared,
) {
    let entry = |m: &EntryMeta<String>| MetaEntry {
        path: m.target.clone(),
        uid: m.owner.map(|o| o.uid),
        gid: m.owner.map(|o| o.gid),
        mtime: m.mtime,
    };
    let todo = finishing(
        meta,
        dirs,
        |t| shared.is_done(Path::new(t)),
        |t| !dir_failed(t),
    );
    let entries: Vec<MetaEntry> = todo.iter().map(entry).collect();
    let batches = batch::pack(entries, u64::MAX, |_| 0, |e| e.path.len());
    // Batches touch disjoint entries: several in flight, as the server has cores.
    let set = run_lanes(vec![(batches, META_BATCHES_AT_ONCE)], |b| {
        let (client, share) = (client.clone(), dest.share.clone());
        async move {
            let paths: Vec<String> = b.iter().map(|e| e.path.clone()).collect();
            Ok((paths, client.set_meta(&share, b).await))
        }
    })
    .await;
    // Every item answers Ok (its own result inside).
    for (paths, set) in set.unwrap_or_default() {
        match set {
            Ok(results) => {
                for (path, r) in paths.into_iter().zip(results) {
                    if let Err(e) = r {
                        shared.fail(dest.with_path(path).display(), ClientError::Remote(e));
                    }
                }
            }
            Err(e) => shared.fail(dest.display(), e),
        }
    }
}

/// `SetMeta` batches an upload keeps in flight.
const META_BATCHES_AT_ONCE: usize = 8;

/// With `-H`: makes each further name of a copied file a hard link to its first name
/// (`(first, further)` pairs), in [`Request::LinkBatch`]es, replacing what the further
/// name held (as `rsync -H` does). A pair whose first name was not copied fails.
///
/// [`Request::LinkBatch`]: ferry_common::msg::Request::LinkBatch
async fn upload_links(
    client: &Client,
    dest: &Remote,
    links: Vec<(String, String)>,
    shared: &Shared,
) {
    let (ready, orphans): (Vec<_>, Vec<_>) = links
        .into_iter()
        .partition(|(first, _)| shared.is_done(Path::new(first)));
    for (first, to) in orphans {
        let why = format!("not linked: its first name {first} was not copied");
        shared.fail(dest.with_path(to).display(), ClientError::Usage(why));
    }
    for batch in pack_links(&dest.share, ready, LINK_BATCH_MAX, |(f, t)| (f, t)) {
        let results = match client.link_batch(&dest.share, batch.clone()).await {
            Ok(r) => r,
            Err(e) => {
                for (_, to) in batch {
                    shared.fail(dest.with_path(to).display(), batch::again(&e));
                }
                continue;
            }
        };
        for ((first, to), result) in batch.into_iter().zip(results) {
            let made = match result {
                Ok(()) => Ok(()),
                // A name from an earlier copy: replaced, as a copied file would be.
                Err(e) if e.kind == ErrorKind::Exists => {
                    match client.remove(&dest.share, &to, false).await {
                        Ok(()) => client.link(&dest.share, &first, &to).await,
                        Err(e) => Err(e),
                    }
                }
                Err(e) => Err(ClientError::Remote(e)),
            };
            match made {
                Ok(()) => lock(&shared.report).hard_links += 1,
                Err(e) => shared.fail(dest.with_path(to).display(), e),
            }
        }
    }
}

/// Whether `dest` is a directory, or `None` (the failure recorded) if it cannot take
/// `sources` sources.
async fn check_dest(
    client: &Client,
    dest: &Remote,
    sources: usize,
    shared: &Shared,
) -> Option<bool> {
    let dest_is_dir = match client.stat(&dest.share, &dest.path, true).await {
        Ok(a) => a.kind == FileKind::Dir,
        Err(e) if e.remote_kind() == Some(ErrorKind::NotFound) => false,
        Err(e) => {
            shared.fail(dest.display(), e);
            return None;
        }
    };
    if dest.dir_hint && !dest_is_dir {
        shared.fail(dest.display(), trailing_slash_needs_a_dir(dest.display()));
        return None;
    }
    if sources > 1 && !dest_is_dir {
        shared.fail(dest.display(), several_sources_need_a_dir(dest.display()));
        return None;
    }
    Some(dest_is_dir)
}

/// Adds the command-line source `src` to `plan` (a tree whole), or records why not.
fn plan_source(
    src: &Path,
    dest: &Remote,
    dest_is_dir: bool,
    opts: &CopyOptions,
    plan: &mut UploadPlan,
    shared: &Shared,
) {
    let shown = || src.display().to_string();
    let target = if dest_is_dir {
        match src.file_name() {
            Some(n) => dest.join(&n.to_string_lossy()).path,
            // `.`, `..`, `/`: like cp, copy the contents into the directory.
            None if fs::metadata(src).is_ok_and(|m| m.is_dir()) => dest.path.clone(),
            None => {
                let why = format!("{}: cannot copy a path without a name", src.display());
                return shared.fail(shown(), ClientError::Usage(why));
            }
        }
    } else {
        dest.path.clone()
    };
    // Command-line sources are followed, like cp and scp do.
    let meta = match fs::metadata(src) {
        Ok(m) => m,
        Err(e) => return shared.fail(shown(), ClientError::local(src, "cannot stat", e)),
    };
    if meta.is_dir() && !opts.recursive {
        let why = format!("{}: is a directory (use -r)", src.display());
        shared.fail(shown(), ClientError::Usage(why));
    } else if meta.is_dir() {
        plan.roots.push((src.to_path_buf(), target.clone()));
        plan_tree(src, &target, &meta, opts.hard_links, plan, shared);
    } else if meta.is_file() {
        plan.roots.push((src.to_path_buf(), target.clone()));
        plan.meta.push(EntryMeta {
            target: target.clone(),
            owner: Some(owner_of(&meta)),
            mtime: None,
        });
        plan.files.push((src.to_path_buf(), target, meta.len()));
    } else {
        let e = std::io::Error::other("not a regular file or directory");
        shared.fail(shown(), ClientError::local(src, "cannot copy", e));
    }
}

/// Adds the local directory `src` and everything below it to `plan`, under `target`.
/// What the walk cannot take is recorded and left out: an unreadable entry or name
/// as an error, a special file as skipped.
fn plan_tree(
    src: &Path,
    target: &str,
    meta: &fs::Metadata,
    hard_links: bool,
    plan: &mut UploadPlan,
    shared: &Shared,
) {
    let fail = |path: PathBuf, op, e| {
        shared.fail(path.display().to_string(), ClientError::local(&path, op, e));
        Ok(())
    };
    let tree = walk(src, meta, &Filter::default(), |problem| match problem {
        Problem::List(path, e) => fail(path, "cannot list", e),
        Problem::Stat(path, e) => fail(path, "cannot stat", e),
        Problem::ReadLink(path, e) => fail(path, "cannot read link", e),
        Problem::NotUtf8(path) => fail(
            path,
            "cannot copy",
            std::io::Error::other("name is not UTF-8"),
        ),
        Problem::Special(path) => {
            lock(&shared.report)
                .skipped
                .push(path.display().to_string());
            Ok(())
        }
    });
    // The callback never refuses a problem, so the walk ends with a tree.
    for dir in tree.into_iter().flatten() {
        let dir_target = join(target, &dir.rel);
        for f in dir.files {
            let file_target = join(&dir_target, &f.name);
            let id = (f.inode, f.nlink);
            if plan.add_file(f.path, file_target.clone(), f.size, id, hard_links) {
                plan.meta.push(EntryMeta {
                    target: file_target,
                    owner: Some(f.owner),
                    mtime: None,
                });
            }
        }
        for link in dir.symlinks {
            let link_target = join(&dir_target, &link.name);
            plan.meta.push(EntryMeta {
                target: link_target.clone(),
                owner: Some(link.owner),
                mtime: Some(link.mtime),
            });
            plan.symlinks.push((link.target, link_target));
        }
        plan.dirs.push(DirItem {
            target: dir_target,
            mode: dir.mode,
            mtime: dir.mtime,
            owner: Some(dir.owner),
        });
    }
}

/// Creates the planned directories, parents first, owner-writable until the end: a
/// level of the tree at a time, up to [`DIR_REQUESTS_AT_ONCE`] of a level at once.
/// The ones that failed go to `gate`; nothing below them is attempted (one error, not
/// one per entry). Each level, once settled, is published through `gate`.
async fn upload_dirs(
    client: &Client,
    dest: &Remote,
    dirs: &[DirItem<String>],
    shared: &Shared,
    gate: &DirGate,
) {
    let mut levels: BTreeMap<usize, Vec<&DirItem<String>>> = BTreeMap::new();
    for d in dirs {
        levels.entry(depth(&d.target)).or_default().push(d);
    }
    for (level_depth, level) in levels {
        let failed = gate.failed();
        let todo: Vec<(String, u32)> = level
            .into_iter()
            .filter(|d| !under_any(&failed, &d.target))
            .map(|d| (d.target.clone(), d.mode))
            .collect();
        // Made with their owner's bits, so that they can be filled in; their own modes
        // are set by `finish_dirs`.
        let made = if client.has_dirs() {
            make_dirs_batched(client, dest, todo).await
        } else {
            make_dirs_one_by_one(client, dest, todo).await
        };
        for (target, made) in made {
            match made {
                Ok(()) => lock(&shared.report).dirs += 1,
                Err(e) => {
                    shared.fail(dest.with_path(target.clone()).display(), e);
                    gate.fail(target);
                }
            }
        }
        gate.level_done(level_depth);
    }
    gate.all_done();
}

/// Makes the directories `todo` (target, mode) with `MakeDirs` batches, several in
/// flight (the directories of one level are independent): one result per directory.
async fn make_dirs_batched(
    client: &Client,
    dest: &Remote,
    todo: Vec<(String, u32)>,
) -> Vec<(String, Result<(), ClientError>)> {
    let dirs: Vec<NewDir> = todo
        .into_iter()
        .map(|(path, mode)| NewDir {
            path,
            mode: mode | 0o700,
        })
        .collect();
    in_batches(
        dirs,
        |d| &d.path,
        |b| {
            let (client, share) = (client.clone(), dest.share.clone());
            async move { client.make_dirs(&share, b).await }
        },
    )
    .await
}

/// Sends `items` in batches of at most `META_BATCH_MAX` items and 32 KiB of paths
/// (`path`), [`DIR_BATCHES_AT_ONCE`] in flight, each with `send`: one `(path, result)`
/// per item.
async fn in_batches<T, Fut>(
    items: Vec<T>,
    path: impl Fn(&T) -> &String,
    send: impl Fn(Vec<T>) -> Fut,
) -> Vec<(String, Result<(), ClientError>)>
where
    Fut: std::future::Future<Output = BatchResults> + Send + 'static,
{
    let batches = batch::pack(items, u64::MAX, |_| 0, |i| path(i).len());
    let done = run_lanes(vec![(batches, DIR_BATCHES_AT_ONCE)], |b| {
        let paths: Vec<String> = b.iter().map(|i| path(i).clone()).collect();
        let sent = send(b);
        async move { Ok((paths, sent.await)) }
    })
    .await;
    // Every item answers Ok (its own result inside).
    each_result(done.unwrap_or_default())
}

/// What a batch of directory requests answered: one result per entry, or the failure of
/// the whole request.
type BatchResults = Result<Vec<Result<(), RemoteError>>, ClientError>;

/// One `(path, result)` per path of batches answered `(paths, results)`: a batch that
/// failed as a whole fails each of its paths.
fn each_result(
    batches: Vec<(Vec<String>, BatchResults)>,
) -> Vec<(String, Result<(), ClientError>)> {
    let mut out = Vec::new();
    for (paths, results) in batches {
        match results {
            Ok(results) => out.extend(
                paths
                    .into_iter()
                    .zip(results)
                    .map(|(p, r)| (p, r.map_err(ClientError::Remote))),
            ),
            Err(e) => {
                let why = e.to_string();
                out.extend(paths.into_iter().map(|p| {
                    let e = ClientError::Remote(RemoteError {
                        kind: ErrorKind::Io,
                        message: why.clone(),
                    });
                    (p, Err(e))
                }));
            }
        }
    }
    out
}

/// Makes the directories `todo` (target, mode) with one `Mkdir` each, up to
/// [`DIR_REQUESTS_AT_ONCE`] in flight (a server without directory batches).
async fn make_dirs_one_by_one(
    client: &Client,
    dest: &Remote,
    todo: Vec<(String, u32)>,
) -> Vec<(String, Result<(), ClientError>)> {
    let made = run_lanes(vec![(todo, DIR_REQUESTS_AT_ONCE)], |(target, mode)| {
        let (client, share) = (client.clone(), dest.share.clone());
        async move {
            let made = client.mkdir(&share, &target, mode | 0o700, true).await;
            Ok((target, made))
        }
    })
    .await;
    // Every item answers Ok (its own result inside).
    made.unwrap_or_default()
}

/// Gives the created directories (but the `dir_failed` ones) their modes and mtimes,
/// once everything inside them is in place: in `SetAttrBatch` batches, a level at a
/// time from the deepest, on a session with directory batches; else up to
/// [`DIR_REQUESTS_AT_ONCE`] `SetAttr`s at once (setting a directory's attributes
/// changes nothing of its parent's).
async fn finish_dirs(
    client: &Client,
    dest: &Remote,
    dirs: &[DirItem<String>],
    dir_failed: &dyn Fn(&str) -> bool,
    shared: &Shared,
) {
    if client.has_dirs() {
        // Owners too (not sent by `upload_meta` then), a level at a time, deepest
        // first: a parent whose mode shuts its owner out is set only after everything
        // below it (which a server not running as root could no longer reach).
        let mut levels: BTreeMap<usize, Vec<AttrEntry>> = BTreeMap::new();
        for d in dirs.iter().filter(|d| !dir_failed(&d.target)) {
            levels.entry(depth(&d.target)).or_default().push(AttrEntry {
                path: d.target.clone(),
                mode: Some(d.mode),
                uid: d.owner.map(|o| o.uid),
                gid: d.owner.map(|o| o.gid),
                mtime: Some(d.mtime),
            });
        }
        for (_, level) in levels.into_iter().rev() {
            let set = in_batches(
                level,
                |e| &e.path,
                |b| {
                    let (client, share) = (client.clone(), dest.share.clone());
                    async move { client.set_attr_batch(&share, b).await }
                },
            )
            .await;
            for (target, set) in set {
                if let Err(e) = set {
                    shared.fail(dest.with_path(target).display(), e);
                }
            }
        }
        return;
    }
    let todo: Vec<_> = dirs
        .iter()
        .filter(|d| !dir_failed(&d.target))
        .map(|d| (d.target.clone(), d.mode, d.mtime))
        .collect();
    let set = run_lanes(
        vec![(todo, DIR_REQUESTS_AT_ONCE)],
        |(target, mode, mtime)| {
            let (client, share) = (client.clone(), dest.share.clone());
            async move {
                let set = client
                    .set_attr(&share, &target, Some(mode), Some(mtime))
                    .await;
                Ok((target, set))
            }
        },
    )
    .await;
    // Every item answers Ok (its own result inside).
    for (target, set) in set.unwrap_or_default() {
        if let Err(e) = set {
            shared.fail(dest.with_path(target).display(), e);
        }
    }
}

/// Directory requests (`Mkdir`, `SetAttr`) an upload keeps in flight.
const DIR_REQUESTS_AT_ONCE: usize = 64;

/// One task of an upload.
enum Task {
    /// Small files in one `UploadBatch`.
    Batch(Vec<SmallUpload>),
    /// One file on the per-file path: source, target.
    File(PathBuf, String),
    /// One symlink: link target, target.
    Symlink(String, String),
}

/// An upload's tasks: files (batches of small ones, then the others, one each) and
/// symlinks.
struct Tasks {
    /// Batches, and files of one chunk or less.
    many: Vec<Task>,
    /// Files of more than one chunk, with their sizes.
    big: Vec<(Task, u64)>,
    symlinks: Vec<Task>,
}

impl Tasks {
    /// The scheduler's lanes: files by size ([`file_lanes`]), symlinks all at once.
    fn lanes(self, jobs: usize) -> Vec<(Vec<Task>, usize)> {
        let mut lanes = file_lanes(self.many, self.big, jobs);
        lanes.push((self.symlinks, UNLIMITED));
        lanes
    }
}

/// The tasks for `files` (source, target, size) and `symlinks` (link target, target).
fn tasks(
    client: &Client,
    files: Vec<(PathBuf, String, u64)>,
    symlinks: Vec<(String, String)>,
) -> Tasks {
    let (small, others): (Vec<_>, Vec<_>) = files
        .into_iter()
        .partition(|(_, _, size)| batch::is_small(client, *size));
    let small = small
        .into_iter()
        .map(|(src, target, size)| SmallUpload { src, target, size })
        .collect();
    let capacity = batch::capacity(client);
    let batches = batch::pack(small, capacity, |i| i.size, |i| i.target.len());
    let chunk = u64::from(client.welcome().chunk_bytes);
    let (medium, big): (Vec<_>, Vec<_>) =
        others.into_iter().partition(|(_, _, size)| *size <= chunk);
    let one = |(src, target, _)| Task::File(src, target);
    Tasks {
        many: medium
            .into_iter()
            .map(one)
            .chain(batches.into_iter().map(Task::Batch))
            .collect(),
        big: big
            .into_iter()
            .map(|(src, target, size)| (Task::File(src, target), size))
            .collect(),
        symlinks: symlinks
            .into_iter()
            .map(|(link, target)| Task::Symlink(link, target))
            .collect(),
    }
}

impl Task {
    /// The task, once the directories its targets go into are settled, without the
    /// targets below a directory that failed; `None` if nothing is left of it.
    async fn admit(self, gate: &DirGate) -> Option<Task> {
        match self {
            Task::Batch(items) => {
                let mut kept = Vec::with_capacity(items.len());
                for item in items {
                    if gate.admit(&item.target).await {
                        kept.push(item);
                    }
                }
                (!kept.is_empty()).then_some(Task::Batch(kept))
            }
            Task::File(_, ref target) | Task::Symlink(_, ref target) => {
                gate.admit(target).await.then_some(self)
            }
        }
    }

    /// Does the task and records its outcome.
    async fn run(self, client: &Client, shared: &Arc<Shared>, dest: &Remote) {
        match self {
            Task::Batch(items) => {
                let progress = shared.progress_fn();
                for (item, outcome) in
                    batch::upload_batch(client, &dest.share, items, &progress).await
                {
                    match outcome {
                        Outcome::Copied(c) => shared.copied(Path::new(&item.target), c),
                        Outcome::Failed(e) => {
                            shared.upload_failed(dest, &item.src, &item.target, e)
                        }
                        Outcome::PerFile => {
                            upload_one(client, shared, dest, item.src, item.target).await
                        }
                    }
                }
            }
            Task::File(src, target) => upload_one(client, shared, dest, src, target).await,
            Task::Symlink(link, target) => {
                match client.symlink(&dest.share, &target, &link).await {
                    Ok(()) => shared.linked(Path::new(&target)),
                    Err(e) => shared.fail(dest.with_path(target).display(), e),
                }
            }
        }
    }
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
        Ok(c) => shared.copied(Path::new(&target), c),
        Err(e) => shared.upload_failed(dest, &src, &target, e),
    }
}
