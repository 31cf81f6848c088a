//! The server side of a backup, read before anything is written: for every source
//! directory, the listings of the same directory in the previous snapshot, in the
//! partial snapshot being continued, and in an interrupted run's partial snapshot.
//!
//! The directories are listed concurrently (at most `jobs` listings at once), a
//! directory as soon as its parent's listings say where it is: a subdirectory is
//! looked for in the previous snapshot only if the parent's listing there names it as
//! a directory (never through a symlink), and likewise in the others.

use std::collections::HashMap;
use std::sync::Arc;

use ferry_common::msg::{Attr, ErrorKind, FileKind};
use tokio::sync::Semaphore;
use tokio::task::JoinSet;

use crate::client::Client;
use crate::error::ClientError;
use crate::walk::{join, LocalDir};

/// Where one source directory goes and what the server already has of it.
#[derive(Clone, Debug, Default)]
pub(super) struct DirPaths {
    /// The directory in the partial snapshot.
    pub dst: String,
    /// True if `dst` may already exist (the partial snapshot is being continued and its
    /// parent lists it), so it is worth listing.
    pub dst_exists: bool,
    /// The directory in the previous snapshot, if it has it.
    pub prev: Option<String>,
    /// The directory in an interrupted run's partial snapshot, if it has it.
    pub resume: Option<String>,
}

/// The server's listings for one directory, by name.
#[derive(Debug, Default)]
pub(super) struct Listings {
    /// `prev`'s entries.
    pub before: HashMap<String, Attr>,
    /// `dst`'s entries (left by an interrupted run of this very snapshot).
    pub already: HashMap<String, Attr>,
    /// `resume`'s entries.
    pub resumed: HashMap<String, Attr>,
}

/// Entries of the server directory `path` by name; empty if it does not exist.
pub(super) async fn listing(
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

async fn listing_of(
    client: &Client,
    share: &str,
    dir: Option<&str>,
) -> Result<HashMap<String, Attr>, ClientError> {
    match dir {
        Some(d) => listing(client, share, d).await,
        None => Ok(HashMap::new()),
    }
}

/// `parent/name` if `parent` exists and `entries` lists `name` as a directory.
fn sub_dir(parent: &Option<String>, entries: &HashMap<String, Attr>, name: &str) -> Option<String> {
    match (parent, entries.get(name)) {
        (Some(p), Some(a)) if a.kind == FileKind::Dir => Some(join(p, name)),
        _ => None,
    }
}

impl DirPaths {
    /// The paths of the subdirectory `name`, given this directory's listings.
    fn child(&self, lists: &Listings, name: &str) -> DirPaths {
        DirPaths {
            dst: join(&self.dst, name),
            dst_exists: self.dst_exists
                && lists
                    .already
                    .get(name)
                    .is_some_and(|a| a.kind == FileKind::Dir),
            prev: sub_dir(&self.prev, &lists.before, name),
            resume: sub_dir(&self.resume, &lists.resumed, name),
        }
    }

    fn needs_listing(&self) -> bool {
        self.dst_exists || self.prev.is_some() || self.resume.is_some()
    }
}

/// The paths and listings of every directory of `dirs` (same order), the source
/// directory's paths being `root`.
pub(super) async fn list_all(
    client: &Client,
    share: &str,
    dirs: &[LocalDir],
    root: DirPaths,
    jobs: usize,
) -> Result<Vec<(DirPaths, Listings)>, ClientError> {
    let mut out: Vec<Option<(DirPaths, Listings)>> = dirs.iter().map(|_| None).collect();
    let slots = Arc::new(Semaphore::new(jobs.max(1)));
    let mut tasks = JoinSet::new();
    let mut first_err = None;
    // Directories whose paths are known: listed in a task if the server may have them,
    // else settled at once with empty listings.
    let mut ready = vec![(0usize, root)];
    loop {
        while let Some((i, paths)) = ready.pop() {
            if first_err.is_some() {
                break;
            }
            if !paths.needs_listing() {
                settle(dirs, i, paths, Listings::default(), &mut ready, &mut out);
                continue;
            }
            let (client, share, slots) = (client.clone(), share.to_string(), slots.clone());
            tasks.spawn(async move {
                let _permit = slots.acquire_owned().await;
                let already = paths.dst_exists.then_some(paths.dst.as_str());
                let lists = tokio::try_join!(
                    listing_of(&client, &share, paths.prev.as_deref()),
                    listing_of(&client, &share, already),
                    listing_of(&client, &share, paths.resume.as_deref()),
                )
                .map(|(before, already, resumed)| Listings {
                    before,
                    already,
                    resumed,
                });
                (i, paths, lists)
            });
        }
        let Some(joined) = tasks.join_next().await else {
            break;
        };
        match joined {
            Ok((i, paths, Ok(lists))) => settle(dirs, i, paths, lists, &mut ready, &mut out),
            Ok((_, _, Err(e))) => {
                first_err.get_or_insert(e);
            }
            Err(e) => {
                first_err.get_or_insert(ClientError::Disconnected(format!(
                    "listing task failed: {e}"
                )));
            }
        }
    }
    if let Some(e) = first_err {
        return Err(e);
    }
    // Every directory is reached from the root through its parent, so all are set.
    out.into_iter()
        .map(|o| o.ok_or_else(|| ClientError::Usage("a source directory was not listed".into())))
        .collect()
}

/// Records directory `i`'s paths and listings, and makes its subdirectories ready.
fn settle(
    dirs: &[LocalDir],
    i: usize,
    paths: DirPaths,
    lists: Listings,
    ready: &mut Vec<(usize, DirPaths)>,
    out: &mut [Option<(DirPaths, Listings)>],
) {
    let children = dirs[i].children.iter();
    ready.extend(children.map(|&c| (c, paths.child(&lists, &dirs[c].name))));
    out[i] = Some((paths, lists));
}
