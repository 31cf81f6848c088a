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
//! the partial snapshot's directories are created, parents before children; every
//! file and symlink is linked, uploaded or created (see `jobs` for the lanes); the
//! directories' modes and mtimes are set, children before parents, after all contents
//! are in; one `Rename` publishes the snapshot. A dry run does the walk, the listings
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

mod batch;
mod jobs;
mod listing;
mod uploads;
mod walk;

use std::collections::HashSet;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use ferry_common::msg::{FileKind, Timestamp};

use crate::backup_admin::drop_stale_entries;
use crate::client::Client;
use crate::copy::Progress;
use crate::error::ClientError;
use crate::filter::Filter;
use crate::transfer::ProgressFn;

use jobs::{file_job, run_jobs, run_lanes, symlink_job, Class};
use listing::{list_all, listing, DirPaths};

pub use batch::LINK_BATCHES_IN_FLIGHT;
pub use jobs::BIG_UPLOADS_IN_FLIGHT;
pub use uploads::UPLOAD_BATCHES_IN_FLIGHT;

/// Prefix of the hidden name a snapshot is built under (not `.ferry-tmp.`, which
/// ferryd's startup cleaner removes: an interrupted snapshot must survive a restart).
pub const PARTIAL_PREFIX: &str = ".partial-";

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
}

/// The snapshot name for `time`: UTC `YYYY-MM-DDTHH-MM-SSZ` (sorts by time; no `:` so
/// it is a valid name everywhere).
pub fn snapshot_name(time: SystemTime) -> String {
    let secs = time
        .duration_since(UNIX_EPOCH)
        .unwrap_or(Duration::ZERO)
        .as_secs();
    let (days, rem) = (secs / 86_400, secs % 86_400);
    let (y, m, d) = civil_from_days(days as i64);
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}-{:02}-{:02}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

/// True if `name` has the shape [`snapshot_name`] produces.
pub fn is_snapshot_name(name: &str) -> bool {
    let b = name.as_bytes();
    b.len() == 20
        && b.iter().enumerate().all(|(i, &c)| match i {
            4 | 7 | 13 | 16 => c == b'-',
            10 => c == b'T',
            19 => c == b'Z',
            _ => c.is_ascii_digit(),
        })
}

/// Proleptic Gregorian (year, month, day) of `days` since 1970-01-01 (Howard
/// Hinnant's `civil_from_days`).
fn civil_from_days(days: i64) -> (i64, u32, u32) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let y = yoe + era * 400 + i64::from(m <= 2);
    (y, m, d)
}

/// `dir/name`, or `name` when `dir` is empty (a trailing `/` of `dir` is dropped).
fn join(dir: &str, name: &str) -> String {
    if dir.is_empty() {
        name.to_string()
    } else {
        format!("{}/{name}", dir.trim_end_matches('/'))
    }
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

/// A [`Progress`] that only counts bytes done.
struct FnProgress(ProgressFn);

impl Progress for FnProgress {
    fn set_total(&self, _bytes: u64) {}
    fn advance(&self, bytes: u64) {
        (self.0)(bytes)
    }
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
    let tree = {
        let (src, filter) = (src.to_path_buf(), opts.filter.clone());
        tokio::task::spawn_blocking(move || walk::walk(&src, &filter))
            .await
            .map_err(|e| ClientError::Disconnected(format!("walking task failed: {e}")))??
    };
    let prefix = prefix.trim_matches('/');
    if !opts.dry_run {
        let mut made = String::new();
        for part in prefix.split('/').filter(|p| !p.is_empty()) {
            made = join(&made, part);
            client.mkdir(share, &made, 0o755, true).await?;
        }
    }
    let name = snapshot_name(now);
    let entries = listing(client, share, prefix).await?;
    let is_dir = |n: &str| entries.get(n).is_some_and(|a| a.kind == FileKind::Dir);
    let previous = entries
        .keys()
        .filter(|n| is_dir(n) && is_snapshot_name(n) && **n < name)
        .max()
        .map(|n| join(prefix, n));
    let partial_name = format!("{PARTIAL_PREFIX}{name}");
    // The newest partial snapshot an earlier interrupted run left (another timestamp):
    // its complete files are linked into this one instead of being sent again.
    let resume = entries
        .keys()
        .filter(|n| {
            is_dir(n)
                && **n != partial_name
                && n.strip_prefix(PARTIAL_PREFIX).is_some_and(is_snapshot_name)
        })
        .max()
        .map(|n| join(prefix, n));
    let partial = join(prefix, &partial_name);
    let root = DirPaths {
        dst: partial.clone(),
        dst_exists: is_dir(&partial_name),
        prev: previous.clone(),
        resume,
    };
    if !opts.dry_run {
        client.mkdir(share, &partial, 0o700, true).await?;
    }
    let mut report = BackupReport {
        snapshot: join(prefix, &name),
        previous,
        dry_run: opts.dry_run,
        ..BackupReport::default()
    };
    progress.set_total(tree.iter().flat_map(|d| &d.files).map(|f| f.size).sum());
    let mut listed = list_all(client, share, &tree, root, opts.jobs).await?;
    if !opts.dry_run {
        // A partial snapshot of this very timestamp is continued: first remove what
        // the source no longer has there, so the snapshot ends up equal to the source.
        for (dir, (paths, lists)) in tree.iter().zip(listed.iter_mut()) {
            if paths.dst_exists {
                let wanted = dir.kinds(&tree);
                let fits = |name: &str, kind: FileKind| wanted.get(name) == Some(&kind);
                drop_stale_entries(client, share, &paths.dst, &mut lists.already, fits).await?;
            }
        }
    }

    let mut work = Vec::new();
    for (dir, (paths, lists)) in tree.iter().zip(&listed) {
        report.files_scanned += dir.files.len() as u64;
        work.extend(dir.files.iter().map(|f| file_job(f, paths, lists)));
        if !opts.dry_run {
            work.extend(dir.symlinks.iter().map(|(n, t)| symlink_job(paths, n, t)));
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
    if !opts.dry_run {
        make_dirs(client, share, by_depth(&tree, &listed), opts.jobs).await?;
    }
    for o in run_jobs(client, share, work, opts.jobs, opts.dry_run, progress).await? {
        match o.class {
            Class::Unchanged => report.files_unchanged += 1,
            Class::Changed => report.files_changed += 1,
            Class::New => report.files_new += 1,
            Class::Other => {}
        }
        report.bytes_sent += o.bytes_sent;
        report.bytes_reused += o.bytes_reused;
    }
    if !opts.dry_run {
        set_dir_attrs(client, share, by_depth(&tree, &listed), opts.jobs).await?;
        client.rename(share, &partial, &report.snapshot).await?;
    }
    report.duration = started.elapsed();
    Ok(report)
}

/// A directory of the partial snapshot and the attributes it gets at the end.
struct DirAttr {
    path: String,
    mode: u32,
    mtime: Timestamp,
}

/// The directories of the partial snapshot by depth, shallowest (the root) first.
fn by_depth(
    tree: &[walk::LocalDir],
    listed: &[(DirPaths, listing::Listings)],
) -> Vec<Vec<DirAttr>> {
    let mut levels: Vec<Vec<DirAttr>> = Vec::new();
    for (dir, (paths, _)) in tree.iter().zip(listed) {
        if levels.len() <= dir.depth {
            levels.resize_with(dir.depth + 1, Vec::new);
        }
        levels[dir.depth].push(DirAttr {
            path: paths.dst.clone(),
            mode: dir.mode,
            mtime: dir.mtime,
        });
    }
    levels
}

/// Runs `op` on every directory of `levels`, a level at a time in the order given,
/// at most `jobs` at once within a level.
async fn per_level<F, Fut>(
    levels: impl Iterator<Item = Vec<DirAttr>>,
    jobs: usize,
    op: F,
) -> Result<(), ClientError>
where
    F: Fn(DirAttr) -> Fut,
    Fut: std::future::Future<Output = Result<(), ClientError>> + Send + 'static,
{
    for level in levels {
        run_lanes(vec![(level, jobs)], &op).await?;
    }
    Ok(())
}

/// Creates the partial snapshot's directories (owner-only until their attributes are
/// set; the root exists), parents before children.
async fn make_dirs(
    client: &Client,
    share: &str,
    levels: Vec<Vec<DirAttr>>,
    jobs: usize,
) -> Result<(), ClientError> {
    per_level(levels.into_iter().skip(1), jobs, |d| {
        let (client, share) = (client.clone(), share.to_string());
        async move { client.mkdir(&share, &d.path, 0o700, true).await }
    })
    .await
}

/// Gives the partial snapshot's directories the source's modes and mtimes, deepest
/// level first: a directory's contents are all in (its mtime stays), and a parent made
/// unsearchable does not stop its children's attributes from being set.
async fn set_dir_attrs(
    client: &Client,
    share: &str,
    levels: Vec<Vec<DirAttr>>,
    jobs: usize,
) -> Result<(), ClientError> {
    per_level(levels.into_iter().rev(), jobs, |d| {
        let (client, share) = (client.clone(), share.to_string());
        async move {
            client
                .set_attr(&share, &d.path, Some(d.mode), Some(d.mtime))
                .await
        }
    })
    .await
}

/// Shares a progress function that ignores its input (for callers without a bar).
pub fn no_progress() -> ProgressFn {
    Arc::new(|_| {})
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn snapshot_names_are_utc_and_sortable() {
        assert_eq!(snapshot_name(UNIX_EPOCH), "1970-01-01T00-00-00Z");
        let t = UNIX_EPOCH + Duration::from_secs(1_795_257_009);
        assert_eq!(snapshot_name(t), "2026-11-21T10-30-09Z");
        let leap = UNIX_EPOCH + Duration::from_secs(951_782_400); // 2000-02-29
        assert_eq!(snapshot_name(leap), "2000-02-29T00-00-00Z");
        assert!(is_snapshot_name(&snapshot_name(t)));
        assert!(snapshot_name(t) < snapshot_name(t + Duration::from_secs(1)));
        assert!(!is_snapshot_name(".partial-2026-11-21T10-30-09Z"));
        assert!(!is_snapshot_name("2026-11-21T10:30:09Z"));
    }
}
