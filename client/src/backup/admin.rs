//! Looking after a backup prefix: listing its snapshots with their sizes
//! (`rcp backup --list`), retention (`--keep N`, `--keep-days D`), removal of stale
//! partial snapshots, and the tidying of a resumed partial snapshot (the plan is
//! `docs/backup-plan.md`).
//!
//! Retention rule (as rsnapshot's and borg's): every rule given names snapshots to
//! keep: `keep` the `keep` newest, `keep_days` those taken less than `keep_days` days
//! before the run. A snapshot is removed only if it is outside every rule given; the
//! run's own new snapshot is never removed. Nothing here runs before the new snapshot
//! is published, and pruning failures are reported, not fatal (see [`PruneReport`]).
//!
//! Removing a snapshot never affects another: unchanged files are hard links, and the
//! server's `Remove` unlinks names, so each other snapshot keeps its own link.

use std::collections::HashMap;
use std::time::{Duration, SystemTime};

use ferry_common::msg::{Attr, DiskUsage, ErrorKind, FileKind};

use crate::client::Client;
use crate::error::ClientError;
use crate::walk::join;

use super::name::{is_snapshot_name, snapshot_time, DAY_SECS, PARTIAL_PREFIX};

/// One snapshot (or partial snapshot) of a prefix, as [`list`] reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SnapshotInfo {
    /// Its timestamp name (`YYYY-MM-DDTHH-MM-SSZ`), without the partial prefix.
    pub name: String,
    /// Share-relative path of its directory.
    pub path: String,
    /// True for the partial snapshot of an interrupted run (`.partial-<name>`).
    pub partial: bool,
    /// What it holds, as the server counted it; `unique_bytes` is what removing it
    /// would free.
    pub usage: DiskUsage,
}

/// The snapshot directories in `prefix`: `(timestamp name, partial)`, oldest first (a
/// partial after the snapshot of the same name). A missing prefix has none.
async fn snapshot_dirs(
    client: &Client,
    share: &str,
    prefix: &str,
) -> Result<Vec<(String, bool)>, ClientError> {
    let entries = match client.list_dir(share, prefix.trim_matches('/')).await {
        Ok(e) => e,
        Err(e) if e.remote_kind() == Some(ErrorKind::NotFound) => Vec::new(),
        Err(e) => return Err(e),
    };
    let mut out: Vec<(String, bool)> = entries
        .into_iter()
        .filter(|e| e.attr.kind == FileKind::Dir)
        .filter_map(|e| match e.name.strip_prefix(PARTIAL_PREFIX) {
            Some(ts) if is_snapshot_name(ts) => Some((ts.to_string(), true)),
            None if is_snapshot_name(&e.name) => Some((e.name, false)),
            _ => None,
        })
        .collect();
    out.sort();
    Ok(out)
}

/// Every snapshot and partial snapshot in `share`/`prefix`, oldest first, each with
/// its usage (one `DiskUsage` request each: the server walks the tree, nothing is
/// listed over the wire).
pub async fn list(
    client: &Client,
    share: &str,
    prefix: &str,
) -> Result<Vec<SnapshotInfo>, ClientError> {
    let mut out = Vec::new();
    for (name, partial) in snapshot_dirs(client, share, prefix).await? {
        let dir = if partial {
            format!("{PARTIAL_PREFIX}{name}")
        } else {
            name.clone()
        };
        let path = join(prefix, &dir);
        let usage = client.disk_usage(share, &path).await?;
        out.push(SnapshotInfo {
            name,
            path,
            partial,
            usage,
        });
    }
    Ok(out)
}

/// Which snapshots to keep; see the module docs for the rule.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Retention {
    /// Keep the newest this many (at least 1).
    pub keep: Option<usize>,
    /// Keep those taken less than this many days before the run.
    pub keep_days: Option<u64>,
}

impl Retention {
    /// True if some rule is given (otherwise nothing is ever removed).
    pub fn is_set(&self) -> bool {
        self.keep.is_some() || self.keep_days.is_some()
    }

    /// The snapshot names among `names` to remove at time `now`, oldest first:
    /// those outside every rule given. `new` (the run's own snapshot) is never among
    /// them; nor is a name that does not parse as a time, since no age rule can judge
    /// it.
    pub fn doomed(&self, names: &[String], new: &str, now: SystemTime) -> Vec<String> {
        if !self.is_set() {
            return Vec::new();
        }
        let mut sorted: Vec<&String> = names.iter().collect();
        sorted.sort();
        let newest_kept = self.keep.map_or(0, |n| n.max(1));
        let cutoff = self
            .keep_days
            .map(|d| now.checked_sub(Duration::from_secs(d.saturating_mul(DAY_SECS))));
        let recent = |name: &str| match (cutoff, snapshot_time(name)) {
            (Some(Some(cutoff)), Some(t)) => t > cutoff,
            // A cutoff before the epoch keeps everything; so does an unparsable name.
            (Some(None), _) | (Some(_), None) => true,
            (None, _) => false,
        };
        let n = sorted.len();
        sorted
            .into_iter()
            .enumerate()
            .filter(|&(i, name)| {
                let among_newest = i + newest_kept >= n;
                name != new && !among_newest && !recent(name)
            })
            .map(|(_, name)| name.clone())
            .collect()
    }
}

/// What [`after_publish`] removed, and what it could not.
#[derive(Debug, Default)]
pub struct PruneReport {
    /// Share-relative paths removed: snapshots outside the retention rules, and stale
    /// partial snapshots.
    pub pruned: Vec<String>,
    /// Paths (or the prefix, if it could not be listed) that could not be removed, with
    /// why.
    pub errors: Vec<(String, ClientError)>,
}

/// Tidies `share`/`prefix` once the snapshot `new` (its timestamp name) is published:
/// removes every partial snapshot older than `new` (interrupted runs, whose useful
/// files `new` already linked) and the snapshots `retention` does not keep at `now`.
/// Never removes `new`; never fails: what could not be done is in the report's
/// `errors`.
pub async fn after_publish(
    client: &Client,
    share: &str,
    prefix: &str,
    new: &str,
    retention: &Retention,
    now: SystemTime,
) -> PruneReport {
    let mut report = PruneReport::default();
    let dirs = match snapshot_dirs(client, share, prefix).await {
        Ok(d) => d,
        Err(e) => {
            report.errors.push((prefix.to_string(), e));
            return report;
        }
    };
    let stale = dirs
        .iter()
        .filter(|(name, partial)| *partial && name.as_str() < new)
        .map(|(name, _)| format!("{PARTIAL_PREFIX}{name}"));
    let published: Vec<String> = dirs
        .iter()
        .filter(|(_, partial)| !partial)
        .map(|(name, _)| name.clone())
        .collect();
    let doomed = retention.doomed(&published, new, now);
    for dir in stale.chain(doomed) {
        let path = join(prefix, &dir);
        match client.remove(share, &path, true).await {
            Ok(()) => report.pruned.push(path),
            Err(e) => report.errors.push((path, e)),
        }
    }
    report
}

/// Makes the server directory `dst` of a resumed partial snapshot fit its source
/// directory: removes each entry of `already` (`dst`'s listing) that the source does not
/// have as the same kind (`fits(name, kind)` is false: gone, excluded, or a directory
/// where the partial has a file or the reverse), and drops it from `already`. Called
/// before `dst` is filled, so the finished snapshot holds exactly the source.
pub(crate) async fn drop_stale_entries(
    client: &Client,
    share: &str,
    dst: &str,
    already: &mut HashMap<String, Attr>,
    fits: impl Fn(&str, FileKind) -> bool,
) -> Result<(), ClientError> {
    let mut stale: Vec<String> = already
        .iter()
        .filter(|(name, attr)| !fits(name, attr.kind))
        .map(|(name, _)| name.clone())
        .collect();
    stale.sort();
    for name in stale {
        client.remove(share, &join(dst, &name), true).await?;
        already.remove(&name);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backup::name::snapshot_name;
    use std::time::UNIX_EPOCH;

    fn at(secs: u64) -> SystemTime {
        UNIX_EPOCH + Duration::from_secs(secs)
    }

    fn names(days: &[u64]) -> Vec<String> {
        days.iter()
            .map(|d| snapshot_name(at(d * DAY_SECS)))
            .collect()
    }

    #[test]
    fn a_snapshot_goes_only_when_outside_every_rule() {
        let all = names(&[1, 2, 3, 4, 5, 6]);
        let now = at(6 * DAY_SECS + 10);
        let new = all[5].clone();
        let keep = |keep, keep_days| Retention { keep, keep_days };
        assert!(keep(None, None).doomed(&all, &new, now).is_empty());
        assert_eq!(keep(Some(2), None).doomed(&all, &new, now), all[..4]);
        // Days 4, 5 and 6 are less than 3 days old.
        assert_eq!(keep(None, Some(3)).doomed(&all, &new, now), all[..3]);
        // Union of what either rule keeps.
        assert_eq!(keep(Some(4), Some(1)).doomed(&all, &new, now), all[..2]);
        assert_eq!(keep(Some(1), Some(3)).doomed(&all, &new, now), all[..3]);
        // The new snapshot stays even when it is not the newest.
        let older_new = all[0].clone();
        assert_eq!(keep(Some(1), None).doomed(&all, &older_new, now), all[1..5]);
        // Keep 0 is never asked for (the CLI refuses it); it keeps the newest anyway.
        assert_eq!(keep(Some(0), None).doomed(&all, &new, now), all[..5]);
    }
}
