//! A new version of a file of which only some stripes are local: a cluster mount's
//! staging file, whose stripes are fetched only as its writes need them
//! ([`Cluster::fetch_stripe`]), published by [`Cluster::put_staged`].
//!
//! A stripe never fetched (*unfetched*) holds no bytes in the local file (a hole
//! there): its bytes are those of the same stripe, over the same range, of the version
//! the file was staged from (its *base*). Publication names objects for such stripes
//! instead of reading them; only the local stripes are hashed, and only those that
//! differ from the version there now are sent.
//!
//! **Invariant (reuse safety).** A new version names only objects that the entry its
//! commit replaces names: every stripe it keeps is the same stripe in the same object
//! ([`Layout::same_stripe`]) of the entry its compare-and-swap is over
//! ([`Expect::Over`]). An object is removed only after a commit replaced the entry
//! naming it (the replaced version's own objects its successor does not name; an
//! unlink) or once no entry names it (`ferry cluster gc`). So while the entry compared
//! with is current nothing has removed its objects, and the commit fails if it is not
//! current any more: no commit names a removed object.
//!
//! Hence an unfetched stripe is kept only where the entry there now names its base's
//! object. Where it does not (another writer published a version with that stripe
//! changed, and removed, or is removing, the base's object), its bytes are fetched now
//! from the base's replicas, checked against the base's manifest, and the stripe is
//! published as a local one; if no replica serves them any more, the publication fails
//! saying so, and nothing is sent or committed.
//!
//! Two other rules were weighed and left:
//! - checking that the base's objects still exist, then naming them: the writer that
//!   replaced the base removes its objects after its own commit, so an object found
//!   now can be removed a moment later, before or after this commit;
//! - leaving every replaced version's objects to `ferry cluster gc`: every rewrite of
//!   a file would then hold its old bytes on the nodes for gc's grace period (24 h by
//!   default), and gc removes an unnamed object older than that all the same, so a
//!   descriptor kept open longer would still need the rule above.

use std::fs;
use std::path::Path;
use std::sync::Arc;

use crate::model::{Layout, ShareConfig};

use super::files::{Expect, Outcome, Put, Version, COMMIT_TRIES};
use super::Cluster;
use ferry_client::error::ClientError;
use ferry_client::transfer::{InPlace, Part, ProgressFn};

/// The stripes of a local file that were never fetched, and where their bytes are.
pub struct Unfetched<'a> {
    /// The version the local file was staged from.
    pub base: &'a Layout,
    /// Its size in bytes.
    pub base_size: u64,
    /// Per stripe of the local file (in `base`'s stripe size): true where its bytes
    /// are not local but `base`'s stripe of the same index, over the same range.
    /// [`Cluster::put_staged`] clears each one it fetches.
    pub stripes: &'a mut [bool],
}

impl Cluster {
    /// Fetches stripe `index` of `layout` (a file of `size` bytes of `share`) into the
    /// local file `local`, at the stripe's own offset, from the first replica in read
    /// order whose copy arrives whole with the layout's manifest (every chunk verified
    /// before it is written). The local file's modification time is left as it was:
    /// fetched bytes are not a change. Returns the bytes that crossed.
    ///
    /// The bytes of the stripe's range are undefined after a failure.
    pub async fn fetch_stripe(
        &self,
        share: &str,
        (layout, size): (&Layout, u64),
        index: usize,
        local: &Path,
    ) -> Result<u64, ClientError> {
        if index >= layout.stripes.len() {
            return Err(ClientError::Cluster(format!(
                "stripe {index}: the layout has {} stripes",
                layout.stripes.len()
            )));
        }
        let file = fs::OpenOptions::new()
            .write(true)
            .open(local)
            .map_err(|e| ClientError::local(local, "cannot open", e))?;
        let mtime = file
            .metadata()
            .and_then(|m| m.modified())
            .map_err(|e| ClientError::local(local, "cannot stat", e))?;
        let file = Arc::new(file);
        let into = InPlace::new(file.clone(), local);
        let quiet = ferry_client::progress::no_progress();
        let got = self
            .get_stripe(share, layout, index, size, Part::InPlace(&into), quiet)
            .await;
        file.set_modified(mtime)
            .map_err(|e| ClientError::local(local, "cannot set mtime", e))?;
        got
    }

    /// Uploads `local` as the new version of `path` of `share`, as
    /// [`Cluster::put_file_reusing`] does, where `unfetched` (if any) names the stripes
    /// whose bytes are not in `local` but in the version it was staged from. Those are
    /// kept where the version there now holds them in the same object; the others are
    /// fetched into `local` first (see the module's invariant), and fail the whole
    /// publication if no replica serves them. Only local stripes are read and hashed.
    pub async fn put_staged(
        &self,
        local: &Path,
        (share, path): (&str, &str),
        config: ShareConfig,
        progress: ProgressFn,
        mut unfetched: Option<Unfetched<'_>>,
    ) -> Result<Put, ClientError> {
        let mut reuse = true;
        for _ in 0..COMMIT_TRIES {
            let current = self.meta().entry(share, path).await?;
            let there = current
                .as_ref()
                .and_then(|v| Some((v.entry.layout.as_ref()?, v.entry.size)))
                .filter(|_| reuse);
            if let Some(u) = unfetched.as_mut() {
                self.fetch_unlent(local, (share, path), u, there, config)
                    .await?;
            }
            // Every stripe still unfetched is the same object in `there`: kept.
            let skip = unfetched
                .as_ref()
                .map_or(Vec::new(), |u| u.stripes.to_vec());
            let size = fs::metadata(local)
                .map_err(|e| ClientError::local(local, "cannot stat", e))?
                .len();
            let base = match there {
                Some((l, old_size)) => {
                    let mut keep = self
                        .same_stripes(local, l, (old_size, size), config, &skip)
                        .await?;
                    for (k, s) in keep.iter_mut().zip(&skip) {
                        *k |= *s;
                    }
                    keep.iter().any(|k| *k).then(|| (l.clone(), keep))
                }
                None => None,
            };
            let how = Version {
                visible: true,
                base: base.as_ref().map(|(l, k)| (l, k.as_slice())),
                expect: Expect::Over(current.as_ref()),
            };
            match self
                .put_version(local, (share, path), config, progress.clone(), how)
                .await?
            {
                Outcome::Done(put) => return Ok(put),
                Outcome::Conflict => self.parent_exists(share, path).await?,
                // Nothing kept the next time: every unfetched stripe is fetched.
                Outcome::OtherAlgorithm => reuse = false,
            }
        }
        Err(ClientError::Cluster(format!(
            "{share}/{path}: changed by other writers {COMMIT_TRIES} times in a row; not written"
        )))
    }

    /// Fetches into `local` every stripe `u` says is unfetched that `there` (the layout
    /// at the path now, with its size; `None`: nothing may be kept) does not hold in
    /// the same object as `u.base` over the same range, and clears it in `u`.
    async fn fetch_unlent(
        &self,
        local: &Path,
        (share, path): (&str, &str),
        u: &mut Unfetched<'_>,
        there: Option<(&Layout, u64)>,
        config: ShareConfig,
    ) -> Result<(), ClientError> {
        let lent = |i: usize| {
            there.is_some_and(|(l, size)| {
                l.stripe_bytes == config.stripe_bytes && l.same_stripe(size, u.base, u.base_size, i)
            })
        };
        for i in 0..u.stripes.len() {
            if !u.stripes[i] || lent(i) {
                continue;
            }
            tracing::info!(
                share,
                path,
                stripe = i,
                "a stripe staged unfetched is not in the version there now; fetching it to send it"
            );
            self.fetch_stripe(share, (u.base, u.base_size), i, local)
                .await
                .map_err(|e| {
                    ClientError::Cluster(format!(
                        "{share}/{path}: stripe {i} of the version this file was opened at is \
                         not in the version there now (another writer replaced the file) and \
                         cannot be read any more: {e}; not written"
                    ))
                })?;
            u.stripes[i] = false;
        }
        Ok(())
    }
}
