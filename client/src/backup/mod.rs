//! Snapshot backups of a local directory tree into `SHARE/PREFIX/<timestamp>/` on one
//! server (issue 5; the plan is `docs/backup-plan.md`).
//!
//! A snapshot is built under the hidden name `PREFIX/.partial-<timestamp>` and renamed
//! to `PREFIX/<timestamp>` (never replacing anything) only after every file in it was
//! committed, which the server does only after verifying every chunk. So a snapshot
//! under its final name is always complete, and an interrupted run leaves the earlier
//! snapshots as they were.
//!
//! Per regular file, against the newest earlier snapshot (the *previous* one):
//! - same size and mtime (ns) as the previous copy: **unchanged**, hard-linked to it
//!   (in batches of many links, [`Client::link_batch`]), nothing sent; should the
//!   server's filesystem refuse one more
//!   link to that inode ([`ErrorKind::TooManyLinks`](ferry_common::msg::ErrorKind)), it
//!   is uploaded with the previous copy as base instead: the server copies every chunk
//!   locally, nothing is sent;
//! - a previous copy that differs: **changed**, uploaded with the previous copy as base
//!   ([`upload_file_with_base`](crate::transfer::upload_file_with_base)), so the server
//!   copies the chunks it already holds and pulls only the others;
//! - no previous copy: **new**, uploaded in full.
//!
//! New and changed files small enough for an `UploadBatch` ([`crate::batch::is_small`],
//! at most 64 KiB) are uploaded whole, many to a request ([`crate::batch::upload_batch`]):
//! such a file is one chunk, which a base spares only when it did not change at all.
//!
//! The run goes in phases over the whole tree, each with many requests in flight: the
//! source is walked (include/exclude rules applied, see [`crate::filter`]); the
//! server's directories (previous snapshot, partial snapshots) are listed concurrently;
//! every file and symlink is planned (see `plan`); the partial snapshot's directories
//! are created, parents before children; every file and symlink is linked, uploaded or
//! created (see `jobs` for the lanes); the directories' modes and mtimes are set,
//! children before parents, after all contents are in; one `Rename` publishes the
//! snapshot. A dry run does the walk, the listings
//! and the planning only, writes nothing anywhere, and estimates what changed files
//! would send from the previous copies' manifests.
//!
//! Interrupted runs: a run finding the partial directory of its own timestamp
//! continues it (a file already there with the source's size and mtime is kept; an
//! upload cut short resumes from the server's partial file and journal). A run finding
//! the newest partial snapshot of another timestamp builds a fresh partial but links
//! each file that one holds with the source's size and mtime instead of sending it, so
//! the new snapshot holds exactly the source (nothing the source has since lost), and
//! what the interrupted run sent is not sent again. (The old partial stays until
//! retention removes it.)
//!
//! "Unchanged" uses rsync's quick check (size and mtime); a file rewritten in place
//! with its mtime put back is not detected.
//!
//! Modules, each depending only on those listed before it: `name` (snapshot names),
//! `listing` (the server's side, read first), `plan` (what each entry needs), `links`
//! and `uploads` (link and small-upload batches), `jobs` (running the plan), `dirs`
//! (the snapshot's directories), [`admin`] (listing, retention, pruning) and
//! [`verify`] (re-reading a snapshot on the server). The source is read by the tree
//! walk copies share ([`crate::walk`]) and the work runs on their scheduler
//! ([`crate::schedule`]). Nothing here prints or decides exit codes: the reports and
//! errors go to the caller (`rcp`'s `cli` module).

pub mod admin;
mod dirs;
mod jobs;
mod links;
mod listing;
mod name;
mod plan;
mod uploads;
pub mod verify;

use std::collections::HashSet;
use std::fs;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use ferry_common::msg::{FileKind, HashAlgorithm};

use crate::client::Client;
use crate::error::ClientError;
use crate::filter::Filter;
use crate::progress::{FnProgress, Progress};
use crate::transfer::ProgressFn;
use crate::walk::{join, walk, LocalDir, Problem};

use admin::drop_stale_entries;
use dirs::{by_depth, make_dirs, set_dir_attrs};
use jobs::run_jobs;
use listing::{list_all, listing, DirPaths, Listings};
use plan::{file_job, symlink_job, Class, Outcome, Work};

pub use crate::progress::no_progress;
pub use jobs::BIG_UPLOADS_IN_FLIGHT;
pub use links::LINK_BATCHES_IN_FLIGHT;
pub use name::{is_snapshot_name, snapshot_name, snapshot_time, PARTIAL_PREFIX};
pub use uploads::UPLOAD_BATCHES_IN_FLIGHT;

/// Small requests (symlinks, uploads of one chunk or less that go in no batch,
/// listings, mkdirs) in flight at once by default; batches of links and of small
/// uploads have lanes of their own. The session queues what exceeds the server's
/// `max_inflight_requests`.
pub const DEFAULT_JOBS: usize = 64;

/// How a backup runs.
#[derive(Debug, Clone)]
pub struct BackupOptions {
    /// Which entries of the source are backed up.
    pub filter: Filter,
    /// Plan only: write nothing on the server, estimate what would be sent.
    pub dry_run: bool,
    /// Small requests in flight at once (see [`DEFAULT_JOBS`]).
    pub jobs: usize,
}

impl Default for BackupOptions {
    fn default() -> Self {
        BackupOptions {
            filter: Filter::default(),
            dry_run: false,
            jobs: DEFAULT_JOBS,
        }
    }
}

/// What a backup did (or, in a dry run, would do).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct BackupReport {
    /// Share-relative path of the finished snapshot (in a dry run: the one that would
    /// be made).
    pub snapshot: String,
    /// Share-relative path of the snapshot it was compared with, if any.
    pub previous: Option<String>,
    /// True if this was a dry run: nothing was written.
    pub dry_run: bool,
    /// Regular files in the source (excluded ones not counted).
    pub files_scanned: u64,
    /// Files hard-linked to the previous snapshot (or found complete in a resumed
    /// partial snapshot).
    pub files_unchanged: u64,
    /// Files uploaded against their previous copy.
    pub files_changed: u64,
    /// Files with no previous copy.
    pub files_new: u64,
    /// Regular files of the previous snapshot's visited directories that the source no
    /// longer has (excluded ones not counted).
    pub files_deleted: u64,
    /// File bytes that crossed the connection (in a dry run: the estimate).
    pub bytes_sent: u64,
    /// File bytes not sent: linked files' sizes plus chunks the server took from a base
    /// or a resumed partial.
    pub bytes_reused: u64,
    /// Wall time of the run.
    pub duration: Duration,
    /// The chunk-hash algorithms of the files uploaded ([`Client::hashes_used`]): the
    /// share's, or a changed file's previous copy's.
    pub hashes: Vec<HashAlgorithm>,
}

/// Backs up the local directory `src` into `share`/`prefix`/[`snapshot_name`]`(now)`
/// with the default [`BackupOptions`]; `progress` is called with the bytes done.
pub async fn backup(
    client: &Client,
    src: &Path,
    share: &str,
    prefix: &str,
    now: SystemTime,
    progress: ProgressFn,
) -> Result<BackupReport, ClientError> {
    let progress = Arc::new(FnProgress(progress));
    backup_with(
        client,
        src,
        share,
        prefix,
        now,
        &BackupOptions::default(),
        progress,
    )
    .await
}

/// Backs up the local directory `src` into `share`/`prefix`/[`snapshot_name`]`(now)`.
///
/// Call order on the server (see the module docs): the prefix's directories are
/// created if missing; listings; the partial snapshot is filled; then one `Rename`
/// publishes it. `progress` gets the total of the files' sizes once the source is
/// walked, then the bytes done. On error the partial snapshot stays for the next run
/// to continue. A dry run (`opts.dry_run`) only lists and reads on the server.
pub async fn backup_with(
    client: &Client,
    src: &Path,
    share: &str,
    prefix: &str,
    now: SystemTime,
    opts: &BackupOptions,
    progress: Arc<dyn Progress>,
) -> Result<BackupReport, ClientError> {
    let started = Instant::now();
    let tree = walk_source(src, &opts.filter).await?;
    let prefix = prefix.trim_matches('/');
    if !opts.dry_run {
        make_prefix(client, share, prefix).await?;
    }
    let root = locate(client, share, prefix, &snapshot_name(now)).await?;
    let partial = root.dst.clone();
    if !opts.dry_run {
        client.mkdir(share, &partial, 0o700, true).await?;
    }
    let mut report = BackupReport {
        snapshot: join(prefix, &snapshot_name(now)),
        previous: root.prev.clone(),
        dry_run: opts.dry_run,
        ..BackupReport::default()
    };
    progress.set_total(tree.iter().flat_map(|d| &d.files).map(|f| f.size).sum());
    let mut listed = list_all(client, share, &tree, root, opts.jobs).await?;
    if !opts.dry_run {
        tidy_resumed(client, share, &tree, &mut listed).await?;
    }
    let work = plan_work(&tree, &listed, opts, &mut report);
    if !opts.dry_run {
        make_dirs(client, share, by_depth(&tree, &listed), opts.jobs).await?;
    }
    let outcomes = run_jobs(client, share, work, opts.jobs, opts.dry_run, progress).await?;
    report.count(&outcomes);
    if !opts.dry_run {
        set_dir_attrs(client, share, by_depth(&tree, &listed), opts.jobs).await?;
        client.rename(share, &partial, &report.snapshot).await?;
    }
    report.duration = started.elapsed();
    report.hashes = client.hashes_used();
    Ok(report)
}

/// Walks the source directory `src` (on a blocking thread). Anything the walk cannot
/// read fails the backup: a snapshot missing part of the source would pass for a
/// complete one. Names that are not UTF-8 are skipped with a warning, special files
/// silently.
pub async fn walk_source(src: &Path, filter: &Filter) -> Result<Vec<LocalDir>, ClientError> {
    let (src, filter) = (src.to_path_buf(), filter.clone());
    tokio::task::spawn_blocking(move || {
        let meta = fs::metadata(&src).map_err(|e| ClientError::local(&src, "cannot stat", e))?;
        walk(&src, &meta, &filter, |problem| match problem {
            Problem::List(path, e) => Err(ClientError::local(path, "cannot list", e)),
            Problem::Stat(path, e) => Err(ClientError::local(path, "cannot stat", e)),
            Problem::ReadLink(path, e) => Err(ClientError::local(path, "cannot read the link", e)),
            Problem::NotUtf8(path) => {
                tracing::warn!(path = %path.display(), "skipping a name that is not UTF-8");
                Ok(())
            }
            Problem::Special(_) => Ok(()),
        })
    })
    .await
    .map_err(|e| ClientError::Disconnected(format!("walking task failed: {e}")))?
}

/// Creates the directories of `prefix` that are missing, parents first.
async fn make_prefix(client: &Client, share: &str, prefix: &str) -> Result<(), ClientError> {
    let mut made = String::new();
    for part in prefix.split('/').filter(|p| !p.is_empty()) {
        made = join(&made, part);
        client.mkdir(share, &made, 0o755, true).await?;
    }
    Ok(())
}

/// The paths of the snapshot `name`'s root directory in `prefix`: its partial
/// directory (and whether an interrupted run of this very timestamp left it), the
/// previous snapshot (the newest older one), and the newest partial snapshot another
/// interrupted run left, whose complete files are linked instead of being sent again.
async fn locate(
    client: &Client,
    share: &str,
    prefix: &str,
    name: &str,
) -> Result<DirPaths, ClientError> {
    let entries = listing(client, share, prefix).await?;
    let is_dir = |n: &str| entries.get(n).is_some_and(|a| a.kind == FileKind::Dir);
    let previous = entries
        .keys()
        .filter(|n| is_dir(n) && is_snapshot_name(n) && n.as_str() < name)
        .max()
        .map(|n| join(prefix, n));
    let partial_name = format!("{PARTIAL_PREFIX}{name}");
    let resume = entries
        .keys()
        .filter(|n| {
            is_dir(n)
                && **n != partial_name
                && n.strip_prefix(PARTIAL_PREFIX).is_some_and(is_snapshot_name)
        })
        .max()
        .map(|n| join(prefix, n));
    Ok(DirPaths {
        dst: join(prefix, &partial_name),
        dst_exists: is_dir(&partial_name),
        prev: previous,
        resume,
    })
}

/// Removes from a partial snapshot of this very timestamp (continued) what the source
/// no longer has there, so that the snapshot ends up equal to the source.
async fn tidy_resumed(
    client: &Client,
    share: &str,
    tree: &[LocalDir],
    listed: &mut [(DirPaths, Listings)],
) -> Result<(), ClientError> {
    for (dir, (paths, lists)) in tree.iter().zip(listed.iter_mut()) {
        if paths.dst_exists {
            let wanted = dir.kinds(tree);
            let fits = |name: &str, kind: FileKind| wanted.get(name) == Some(&kind);
            drop_stale_entries(client, share, &paths.dst, &mut lists.already, fits).await?;
        }
    }
    Ok(())
}

/// The work for every file and symlink of `tree` (symlinks not in a dry run), counting
/// the files scanned and those deleted since the previous snapshot into `report`.
fn plan_work(
    tree: &[LocalDir],
    listed: &[(DirPaths, Listings)],
    opts: &BackupOptions,
    report: &mut BackupReport,
) -> Vec<Work> {
    let mut work = Vec::new();
    for (dir, (paths, lists)) in tree.iter().zip(listed) {
        report.files_scanned += dir.files.len() as u64;
        work.extend(dir.files.iter().map(|f| file_job(f, paths, lists)));
        if !opts.dry_run {
            work.extend(
                dir.symlinks
                    .iter()
                    .map(|l| symlink_job(paths, &l.name, &l.target)),
            );
        }
        // Files the previous snapshot had here (and the rules still cover) that the
        // source no longer has.
        let here: HashSet<&str> = dir.files.iter().map(|f| f.name.as_str()).collect();
        let gone = lists.before.iter().filter(|(n, a)| {
            a.kind == FileKind::File
                && !here.contains(n.as_str())
                && !opts.filter.excludes(&join(&dir.rel, n), false)
        });
        report.files_deleted += gone.count() as u64;
    }
    work
}

impl BackupReport {
    /// Adds the jobs' `outcomes` to the counts.
    fn count(&mut self, outcomes: &[Outcome]) {
        for o in outcomes {
            match o.class {
                Class::Unchanged => self.files_unchanged += 1,
                Class::Changed => self.files_changed += 1,
                Class::New => self.files_new += 1,
                Class::Other => {}
            }
            self.bytes_sent += o.bytes_sent;
            self.bytes_reused += o.bytes_reused;
        }
    }
}
