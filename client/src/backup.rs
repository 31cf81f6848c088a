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
//!   ([`Client::link`]), nothing sent;
//! - a previous copy that differs: **changed**, uploaded with the previous copy as base
//!   ([`upload_file_with_base`]), so the server copies the chunks it already holds and
//!   pulls only the others;
//! - no previous copy: **new**, uploaded in full.
//!
//! Interrupted runs: a run finding the partial directory of its own timestamp
//! continues it (a file already there with the source's size and mtime is kept; an
//! upload cut short resumes from the server's partial file and journal). A run finding
//! the newest partial snapshot of another timestamp builds a fresh partial but links
//! each file that one holds with the source's size and mtime instead of sending it, so
//! the new snapshot holds exactly the source (nothing the source has since lost), and
//! what the interrupted run sent is not sent again. (The old partial is removed once
//! the new snapshot is published: [`crate::backup_admin::after_publish`].) A partial of
//! its own timestamp loses the entries the source no longer has before it is filled.
//!
//! "Unchanged" uses rsync's quick check (size and mtime); a file rewritten in place
//! with its mtime put back is not detected.

use std::collections::HashMap;
use std::fs;
use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use ferry_common::attr::attr_of;
use ferry_common::msg::{Attr, ErrorKind, FileKind, Timestamp};

use crate::backup_admin::drop_stale_entries;
use crate::client::Client;
use crate::error::ClientError;
use crate::transfer::{upload_file, upload_file_with_base, ProgressFn};

/// Prefix of the hidden name a snapshot is built under (not `.ferry-tmp.`, which
/// ferryd's startup cleaner removes: an interrupted snapshot must survive a restart).
pub const PARTIAL_PREFIX: &str = ".partial-";

/// What a backup did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct BackupReport {
    /// Share-relative path of the finished snapshot.
    pub snapshot: String,
    /// Share-relative path of the snapshot it was compared with, if any.
    pub previous: Option<String>,
    /// Regular files in the source.
    pub files_scanned: u64,
    /// Files hard-linked to the previous snapshot (or found complete in a resumed
    /// partial snapshot).
    pub files_unchanged: u64,
    /// Files uploaded against their previous copy.
    pub files_changed: u64,
    /// Files with no previous copy.
    pub files_new: u64,
    /// Regular files of the previous snapshot's visited directories that the source no
    /// longer has.
    pub files_deleted: u64,
    /// File bytes that crossed the connection.
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

fn join(dir: &str, name: &str) -> String {
    if dir.is_empty() {
        name.to_string()
    } else {
        format!("{}/{name}", dir.trim_end_matches('/'))
    }
}

/// Entries of the server directory `path` by name; empty if it does not exist.
async fn listing(
    client: &Client,
    share: &str,
    path: &str,
) -> Result<HashMap<String, Attr>, ClientError> {
    match client.list_dir(share, path).await {
        Ok(entries) => Ok(entries.into_iter().map(|e| (e.name, e.attr)).collect()),
        Err(e) if e.remote_kind() == Some(ErrorKind::NotFound) => Ok(HashMap::new()),
        Err(e) => Err(e),
    }
}

fn same_version(a: &Attr, size: u64, mtime: Timestamp) -> bool {
    a.kind == FileKind::File && a.size == size && a.mtime == mtime
}

/// Backs up the local directory `src` into `share`/`prefix`/[`snapshot_name`]`(now)`.
///
/// Call order on the server: the prefix's directories are created if missing; the
/// partial snapshot is filled depth first (directories before their contents, each
/// directory's mode and mtime set after its contents); then one `Rename` publishes it.
/// On error the partial snapshot stays for the next run with the same `now` to continue
/// (a later run with another `now` starts a new partial and leaves this one for
/// [`crate::backup_admin::after_publish`] to remove).
pub async fn backup(
    client: &Client,
    src: &Path,
    share: &str,
    prefix: &str,
    now: SystemTime,
    progress: ProgressFn,
) -> Result<BackupReport, ClientError> {
    let started = Instant::now();
    let meta = fs::metadata(src).map_err(|e| ClientError::local(src, "cannot stat", e))?;
    if !meta.is_dir() {
        return Err(ClientError::local(
            src,
            "cannot back up",
            std::io::Error::other("not a directory"),
        ));
    }
    let prefix = prefix.trim_matches('/');
    let mut made = String::new();
    for part in prefix.split('/').filter(|p| !p.is_empty()) {
        made = join(&made, part);
        client.mkdir(share, &made, 0o755, true).await?;
    }
    let name = snapshot_name(now);
    let entries = listing(client, share, prefix).await?;
    let previous = entries
        .iter()
        .filter(|(n, a)| a.kind == FileKind::Dir && is_snapshot_name(n) && **n < name)
        .map(|(n, _)| n.clone())
        .max()
        .map(|n| join(prefix, &n));
    let partial_name = format!("{PARTIAL_PREFIX}{name}");
    // The newest partial snapshot an earlier interrupted run left (another timestamp):
    // its complete files are linked into this one instead of being sent again.
    let resume = entries
        .iter()
        .filter(|(n, a)| {
            a.kind == FileKind::Dir
                && **n != partial_name
                && n.strip_prefix(PARTIAL_PREFIX).is_some_and(is_snapshot_name)
        })
        .map(|(n, _)| n.clone())
        .max()
        .map(|n| join(prefix, &n));
    let partial = join(prefix, &partial_name);
    client.mkdir(share, &partial, 0o700, true).await?;
    let mut report = BackupReport {
        snapshot: join(prefix, &name),
        previous: previous.clone(),
        ..BackupReport::default()
    };
    let ctx = Ctx {
        client,
        share,
        progress,
    };
    let root = Dir {
        src: src.to_path_buf(),
        dst: partial.clone(),
        prev: previous,
        resume,
    };
    ctx.tree(root, &mut report).await?;
    client.rename(share, &partial, &report.snapshot).await?;
    report.duration = started.elapsed();
    Ok(report)
}

struct Ctx<'a> {
    client: &'a Client,
    share: &'a str,
    progress: ProgressFn,
}

/// One directory to back up: the local `src`, the server directory `dst` (existing)
/// it is copied to, and the same directory in the previous snapshot and in the partial
/// snapshot being resumed, where they exist.
struct Dir {
    src: std::path::PathBuf,
    dst: String,
    prev: Option<String>,
    resume: Option<String>,
}

/// The server's listings for one [`Dir`], by name.
struct Listings {
    /// `prev`'s entries.
    before: HashMap<String, Attr>,
    /// `dst`'s entries (left by an interrupted run of this very snapshot).
    already: HashMap<String, Attr>,
    /// `resume`'s entries.
    resumed: HashMap<String, Attr>,
}

/// `parent/name` if `parent` exists and `entries` lists `name` as a directory.
fn sub_dir(parent: &Option<String>, entries: &HashMap<String, Attr>, name: &str) -> Option<String> {
    match (parent, entries.get(name)) {
        (Some(p), Some(a)) if a.kind == FileKind::Dir => Some(join(p, name)),
        _ => None,
    }
}

impl Ctx<'_> {
    async fn listing_of(&self, dir: &Option<String>) -> Result<HashMap<String, Attr>, ClientError> {
        match dir {
            Some(d) => listing(self.client, self.share, d).await,
            None => Ok(HashMap::new()),
        }
    }

    /// Fills `root.dst` from `root.src` and everything below it.
    async fn tree(&self, root: Dir, report: &mut BackupReport) -> Result<(), ClientError> {
        // Depth first with an explicit stack of directories still to visit, so deep
        // trees cannot overflow the stack. Directory attributes are set once a
        // directory's contents are in, in reverse visiting order.
        let meta =
            fs::metadata(&root.src).map_err(|e| ClientError::local(&root.src, "cannot stat", e))?;
        let mut finish = vec![(
            root.dst.clone(),
            meta.mode() & 0o7777,
            attr_of(&meta, None).mtime,
        )];
        let mut todo = vec![root];
        while let Some(dir) = todo.pop() {
            let mut names: Vec<_> = fs::read_dir(&dir.src)
                .map_err(|e| ClientError::local(&dir.src, "cannot list", e))?
                .map(|e| e.map(|e| e.file_name()))
                .collect::<Result<_, _>>()
                .map_err(|e| ClientError::local(&dir.src, "cannot list", e))?;
            names.sort();
            let mut lists = Listings {
                before: self.listing_of(&dir.prev).await?,
                already: listing(self.client, self.share, &dir.dst).await?,
                resumed: self.listing_of(&dir.resume).await?,
            };
            drop_stale_entries(
                self.client,
                self.share,
                &dir.dst,
                &dir.src,
                &mut lists.already,
            )
            .await?;
            let mut seen = 0u64;
            let mut jobs = Vec::new();
            for name in names {
                let path = dir.src.join(&name);
                let Some(name) = name.to_str() else {
                    tracing::warn!(path = %path.display(), "skipping a name that is not UTF-8");
                    continue;
                };
                let meta = fs::symlink_metadata(&path)
                    .map_err(|e| ClientError::local(&path, "cannot stat", e))?;
                let to = join(&dir.dst, name);
                if meta.is_dir() {
                    self.client.mkdir(self.share, &to, 0o700, true).await?;
                    let attr = attr_of(&meta, None);
                    finish.push((to.clone(), meta.mode() & 0o7777, attr.mtime));
                    todo.push(Dir {
                        src: path,
                        dst: to,
                        prev: sub_dir(&dir.prev, &lists.before, name),
                        resume: sub_dir(&dir.resume, &lists.resumed, name),
                    });
                } else if meta.file_type().is_symlink() {
                    let target = fs::read_link(&path)
                        .map_err(|e| ClientError::local(&path, "cannot read the link", e))?;
                    self.client
                        .symlink(self.share, &to, &target.to_string_lossy())
                        .await?;
                } else if meta.is_file() {
                    report.files_scanned += 1;
                    if lists
                        .before
                        .get(name)
                        .is_some_and(|a| a.kind == FileKind::File)
                    {
                        seen += 1;
                    }
                    jobs.push(self.plan_file(&path, &meta, &dir, &lists, name));
                }
            }
            self.run_jobs(jobs, report).await?;
            let old_files = lists
                .before
                .values()
                .filter(|a| a.kind == FileKind::File)
                .count();
            report.files_deleted += (old_files as u64).saturating_sub(seen);
        }
        for (dir, mode, mtime) in finish.into_iter().rev() {
            self.client
                .set_attr(self.share, &dir, Some(mode), Some(mtime))
                .await?;
        }
        Ok(())
    }

    /// What to do with one regular file: keep, link, upload with a base, or upload
    /// (see the module docs).
    fn plan_file(
        &self,
        path: &Path,
        meta: &fs::Metadata,
        dir: &Dir,
        lists: &Listings,
        name: &str,
    ) -> FileJob {
        let size = meta.len();
        let mtime = attr_of(meta, None).mtime;
        let to = join(&dir.dst, name);
        let old = lists.before.get(name);
        let unchanged = old.is_some_and(|a| same_version(a, size, mtime));
        let class = match unchanged {
            true => Class::Unchanged,
            false if old.is_some() => Class::Changed,
            false => Class::New,
        };
        let job = |action| FileJob {
            class,
            size,
            action,
        };
        // Left complete by an interrupted run of this snapshot: kept.
        if lists
            .already
            .get(name)
            .is_some_and(|a| same_version(a, size, mtime))
        {
            return job(Action::Keep);
        }
        // A stale entry of an interrupted run is in the way of a link (Link never
        // replaces): an upload replaces it atomically instead.
        let free = !lists.already.contains_key(name);
        // Linked from the previous snapshot, or from the partial snapshot of an
        // interrupted run that holds this version of the file.
        let link_from = match (&dir.prev, &dir.resume) {
            (Some(p), _) if unchanged => Some(join(p, name)),
            (_, Some(r))
                if lists
                    .resumed
                    .get(name)
                    .is_some_and(|a| same_version(a, size, mtime)) =>
            {
                Some(join(r, name))
            }
            _ => None,
        };
        if let (Some(from), true) = (link_from, free) {
            return job(Action::Link { from, to });
        }
        let base = match (old, &dir.prev) {
            (Some(a), Some(p)) if a.kind == FileKind::File => Some(join(p, name)),
            _ => None,
        };
        job(Action::Upload {
            path: path.to_path_buf(),
            to,
            base,
        })
    }

    /// Runs `jobs`, at most [`FILES_IN_FLIGHT`] at once, and adds their outcome to
    /// `report`. On the first failure no further job starts; the running ones are
    /// waited for, then the failure is returned.
    async fn run_jobs(
        &self,
        jobs: Vec<FileJob>,
        report: &mut BackupReport,
    ) -> Result<(), ClientError> {
        let mut tasks = tokio::task::JoinSet::new();
        let mut first_err = None;
        let mut jobs = jobs.into_iter();
        loop {
            while first_err.is_none() && tasks.len() < FILES_IN_FLIGHT {
                let Some(job) = jobs.next() else { break };
                let (client, share) = (self.client.clone(), self.share.to_string());
                let progress = self.progress.clone();
                tasks.spawn(async move { job.run(&client, &share, progress).await });
            }
            let Some(joined) = tasks.join_next().await else {
                break;
            };
            match joined {
                Ok(Ok((job, sent, reused))) => {
                    match job {
                        Class::Unchanged => report.files_unchanged += 1,
                        Class::Changed => report.files_changed += 1,
                        Class::New => report.files_new += 1,
                    }
                    report.bytes_sent += sent;
                    report.bytes_reused += reused;
                }
                Ok(Err(e)) => {
                    first_err.get_or_insert(e);
                }
                Err(e) => {
                    first_err.get_or_insert(ClientError::Disconnected(format!(
                        "backup task failed: {e}"
                    )));
                }
            }
        }
        match first_err {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }
}

/// Files of one directory in flight at once.
pub const FILES_IN_FLIGHT: usize = 8;

/// How a file compares with the previous snapshot.
#[derive(Debug, Clone, Copy)]
enum Class {
    Unchanged,
    Changed,
    New,
}

/// What one file needs.
enum Action {
    /// Already complete in the partial snapshot.
    Keep,
    /// Hard-link `from` (previous snapshot or an interrupted partial) to `to`.
    Link { from: String, to: String },
    /// Upload the local `path` to `to`, against `base` if any.
    Upload {
        path: std::path::PathBuf,
        to: String,
        base: Option<String>,
    },
}

struct FileJob {
    class: Class,
    size: u64,
    action: Action,
}

impl FileJob {
    /// Does the job; returns its class, bytes sent and bytes reused.
    async fn run(
        self,
        client: &Client,
        share: &str,
        progress: ProgressFn,
    ) -> Result<(Class, u64, u64), ClientError> {
        match self.action {
            Action::Keep => {
                progress(self.size);
                Ok((self.class, 0, self.size))
            }
            Action::Link { from, to } => {
                client.link(share, &from, &to).await?;
                progress(self.size);
                Ok((self.class, 0, self.size))
            }
            Action::Upload { path, to, base } => {
                let copied = match base {
                    Some(base) => {
                        upload_file_with_base(client, &path, share, &to, &base, progress).await?
                    }
                    None => upload_file(client, &path, share, &to, progress).await?,
                };
                Ok((self.class, copied.bytes_sent, copied.bytes_reused))
            }
        }
    }
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
