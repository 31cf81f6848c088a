//! What a backup does per entry: the plan, made from the source tree and the server's
//! listings before anything is written.
//!
//! Every regular file and symlink of the source becomes one [`Work`]: a hard link
//! ([`LinkJob`], batched with others, see `links`) or a [`Job`] of its own (keep,
//! upload, symlink). A file is classed against the previous snapshot ([`Class`]) by
//! rsync's quick check: the same size and mtime (ns) is unchanged.

use std::path::PathBuf;

use ferry_common::msg::{Attr, FileKind, Timestamp};

use crate::walk::{join, LocalFile};

use super::listing::{DirPaths, Listings};

/// How a file compares with the previous snapshot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Class {
    Unchanged,
    Changed,
    New,
    /// Not a regular file (a symlink): not counted.
    Other,
}

/// What one entry needs, but a link (a [`LinkJob`]: hard-link the previous snapshot's
/// or an interrupted partial's copy).
pub(super) enum Action {
    /// Already complete in the partial snapshot.
    Keep,
    /// Upload the local `path` to `to`, against `base` if any.
    Upload {
        path: PathBuf,
        to: String,
        base: Option<String>,
    },
    /// Create the symlink `to` -> `target`.
    Symlink { to: String, target: String },
}

/// One entry's work.
pub(super) struct Job {
    pub class: Class,
    pub size: u64,
    pub action: Action,
}

/// One entry's work: a link, batched with others, or a job of its own.
pub(super) enum Work {
    Link(LinkJob),
    Job(Job),
}

/// What a job did (or, in a dry run, would do).
#[derive(Debug, Clone, Copy)]
pub(super) struct Outcome {
    pub class: Class,
    pub bytes_sent: u64,
    pub bytes_reused: u64,
}

fn same_version(a: &Attr, size: u64, mtime: Timestamp) -> bool {
    a.kind == FileKind::File && a.size == size && a.mtime == mtime
}

/// The job for the symlink `name` -> `target` of the directory at `paths`.
pub(super) fn symlink_job(paths: &DirPaths, name: &str, target: &str) -> Work {
    Work::Job(Job {
        class: Class::Other,
        size: 0,
        action: Action::Symlink {
            to: join(&paths.dst, name),
            target: target.to_string(),
        },
    })
}

/// The work for one regular file: keep, link, upload with a base, or upload (see the
/// module docs of `backup`).
pub(super) fn file_job(file: &LocalFile, paths: &DirPaths, lists: &Listings) -> Work {
    let (name, size, mtime) = (file.name.as_str(), file.size, file.mtime);
    let to = join(&paths.dst, name);
    let old = lists.before.get(name).filter(|a| a.kind == FileKind::File);
    let unchanged = old.is_some_and(|a| same_version(a, size, mtime));
    let class = match (unchanged, old) {
        (true, _) => Class::Unchanged,
        (false, Some(_)) => Class::Changed,
        (false, None) => Class::New,
    };
    let job = |action| {
        Work::Job(Job {
            class,
            size,
            action,
        })
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
    let link_from = match (&paths.prev, &paths.resume) {
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
    let path = file.path.clone();
    if let (Some(from), true) = (link_from, free) {
        return Work::Link(LinkJob {
            class,
            size,
            from,
            to,
            path,
        });
    }
    let base = match (old, &paths.prev) {
        (Some(_), Some(p)) => Some(join(p, name)),
        _ => None,
    };
    job(Action::Upload { path, to, base })
}

/// One link of a batch: hard-link `from` to `to`; should the server refuse it with
/// `TooManyLinks`, upload the local `path` to `to` with `from` as base instead.
pub(super) struct LinkJob {
    pub class: Class,
    pub size: u64,
    pub from: String,
    pub to: String,
    pub path: PathBuf,
}
