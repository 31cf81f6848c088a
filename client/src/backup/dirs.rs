//! The directories of a partial snapshot: created before their contents, parents
//! first and owner-only; given the source's modes and mtimes after their contents,
//! children first. Each level runs many requests at once on the shared scheduler: on a
//! session with directory batches (`dirs`), `MakeDirs` and `SetAttrBatch` batches of
//! up to 256 directories, else one `Mkdir` or `SetAttr` per directory.

use ferry_common::msg::{AttrEntry, NewDir, RemoteError, Timestamp};

use crate::batch::{self, DIR_BATCHES_AT_ONCE};
use crate::client::Client;
use crate::error::ClientError;
use crate::schedule::run_lanes;
use crate::walk::LocalDir;

use super::listing::{DirPaths, Listings};

/// A directory of the partial snapshot and the attributes it gets at the end.
pub(super) struct DirAttr {
    path: String,
    mode: u32,
    mtime: Timestamp,
}

/// The directories of the partial snapshot by depth, shallowest (the root) first.
pub(super) fn by_depth(tree: &[LocalDir], listed: &[(DirPaths, Listings)]) -> Vec<Vec<DirAttr>> {
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

/// Runs `op` on batches of the directories of `levels` (at most 256 each), a level at
/// a time in the order given, [`DIR_BATCHES_AT_ONCE`] at once within a level; fails
/// with the first directory that failed.
async fn per_level_batched<F, Fut>(
    levels: impl Iterator<Item = Vec<DirAttr>>,
    op: F,
) -> Result<(), ClientError>
where
    F: Fn(Vec<DirAttr>) -> Fut,
    Fut: std::future::Future<Output = Result<Vec<Result<(), RemoteError>>, ClientError>>
        + Send
        + 'static,
{
    for level in levels {
        let batches = batch::pack(level, u64::MAX, |_| 0, |d| d.path.len());
        for results in run_lanes(vec![(batches, DIR_BATCHES_AT_ONCE)], &op).await? {
            results
                .into_iter()
                .try_for_each(|r| r.map_err(ClientError::Remote))?;
        }
    }
    Ok(())
}

/// Creates the partial snapshot's directories (owner-only until their attributes are
/// set; the root exists), parents before children.
pub(super) async fn make_dirs(
    client: &Client,
    share: &str,
    levels: Vec<Vec<DirAttr>>,
    jobs: usize,
) -> Result<(), ClientError> {
    if client.has_dirs() {
        return per_level_batched(levels.into_iter().skip(1), |b| {
            let (client, share) = (client.clone(), share.to_string());
            let dirs = b
                .into_iter()
                .map(|d| NewDir {
                    path: d.path,
                    mode: 0o700,
                })
                .collect();
            async move { client.make_dirs(&share, dirs).await }
        })
        .await;
    }
    per_level(levels.into_iter().skip(1), jobs, |d| {
        let (client, share) = (client.clone(), share.to_string());
        async move { client.mkdir(&share, &d.path, 0o700, true).await }
    })
    .await
}

/// Gives the partial snapshot's directories the source's modes and mtimes, deepest
/// level first: a directory's contents are all in (its mtime stays), and a parent made
/// unsearchable does not stop its children's attributes from being set.
pub(super) async fn set_dir_attrs(
    client: &Client,
    share: &str,
    levels: Vec<Vec<DirAttr>>,
    jobs: usize,
) -> Result<(), ClientError> {
    if client.has_dirs() {
        return per_level_batched(levels.into_iter().rev(), |b| {
            let (client, share) = (client.clone(), share.to_string());
            let entries = b
                .into_iter()
                .map(|d| AttrEntry {
                    path: d.path,
                    mode: Some(d.mode),
                    uid: None,
                    gid: None,
                    mtime: Some(d.mtime),
                })
                .collect();
            async move { client.set_attr_batch(&share, entries).await }
        })
        .await;
    }
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
