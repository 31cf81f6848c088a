//! `ferry cluster repair`: brings every stripe back to its share's replica count.
//!
//! For each stripe with fewer live replicas than its share asks for (a node died, or
//! the file was written while too few nodes were alive), the next nodes in the file's
//! placement order get a copy: fetched from a live replica over the data path and
//! checked against the layout's manifest, then uploaded to the new node, which
//! verifies and fsyncs it like any upload. The layout is then updated by a
//! compare-and-swap on the entry: a file rewritten meanwhile is left to its writer.
//! A dead node is dropped from a stripe's replicas once the stripe has enough live
//! ones, so a node that comes back later never serves that stripe (its old copy is
//! named by no layout).
//!
//! The copy goes node to node: the new node is asked ([`Client::replicate`]) to fetch
//! the object from a live holder over the data path (the holder pushes it into the new
//! node's buffers) and checks it against the layout's manifest before publishing it.
//! Only a node of an older Ferry, without the `cluster` capability, gets its copy
//! through the host running `repair` instead (a temporary file there).
//!
//! [`Client::replicate`]: crate::Client::replicate

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use crate::model::{placement, stripe_range, EntryKind, Layout, STORE_SHARE};
use ferry_common::msg::{Hash256, HashAlgorithm};
use serde::Serialize;

use super::health::Progress;
use super::meta::Commit;
use super::Cluster;
use crate::Client;
use ferry_client::error::ClientError;
use ferry_client::progress::no_progress;
use ferry_client::transfer::{self, Assembly};

/// What a repair did.
#[derive(Debug, Clone, Default, Serialize)]
pub struct RepairReport {
    /// Files looked at.
    pub files: u64,
    /// Stripes that got new replicas.
    pub stripes_repaired: u64,
    /// Replicas made.
    pub replicas_added: u64,
    /// Bytes copied to new replicas.
    pub bytes_copied: u64,
    /// Stripes with no live replica: nothing to copy from until a node comes back.
    pub unavailable: u64,
    /// Stripes that could not be repaired, and why.
    pub failed: Vec<String>,
}

/// Repairs every share; `scratch` is a local directory for the copies in passing.
pub async fn repair(cluster: &Cluster, scratch: &Path) -> Result<RepairReport, ClientError> {
    let live = cluster.refresh_nodes().await?;
    let shares: HashMap<String, u8> = cluster
        .meta()
        .shares()
        .await?
        .into_iter()
        .map(|(n, c)| (n, c.replicas))
        .collect();
    let mut report = RepairReport::default();
    for (share, path, v) in cluster.meta().all_entries().await? {
        if v.entry.kind != EntryKind::File {
            continue;
        }
        report.files += 1;
        let Some(mut layout) = v.entry.layout.clone() else {
            continue;
        };
        let want = usize::from(shares.get(&share).copied().unwrap_or(1)).min(live.len());
        let mut changed = false;
        for i in 0..layout.stripes.len() {
            let replicas = layout.stripes[i].replicas.clone();
            let (alive, dead): (Vec<String>, Vec<String>) =
                replicas.into_iter().partition(|r| cluster.is_live(r));
            if alive.is_empty() {
                report.unavailable += 1;
                continue;
            }
            if alive.len() >= want && dead.is_empty() {
                continue;
            }
            let mut holders = alive.clone();
            let range = stripe_range(v.entry.size, layout.stripe_bytes, i);
            let len = range.end - range.start;
            let mut tried = holders.clone();
            tried.extend(dead.iter().cloned());
            while holders.len() < want {
                let usable = cluster.usable_nodes();
                let Some(target) = placement::next_replica(&layout.id, &usable, &tried, len) else {
                    break;
                };
                let target = target.id.clone();
                tried.push(target.clone());
                match copy_stripe(cluster, &share, &layout, i, len, &alive, &target, scratch).await
                {
                    Ok(()) => {
                        holders.push(target);
                        report.replicas_added += 1;
                        report.bytes_copied += len;
                    }
                    Err(e) => report
                        .failed
                        .push(format!("{share}/{path} stripe {i} to {target}: {e}")),
                }
            }
            if holders.len() > alive.len() || holders.len() >= want {
                if holders.len() < want {
                    // Not enough live nodes: the dead ones stay listed, for when they return.
                    holders.extend(dead);
                }
                if holders != layout.stripes[i].replicas {
                    layout.stripes[i].replicas = holders;
                    changed = true;
                    report.stripes_repaired += 1;
                }
            }
        }
        if changed {
            let mut entry = v.entry.clone();
            entry.layout = Some(layout);
            if cluster
                .meta()
                .commit(&share, &path, &entry, v.revision)
                .await?
                == Commit::Conflict
            {
                report.failed.push(format!(
                    "{share}/{path}: changed during the repair; run it again"
                ));
            }
        }
    }
    Ok(report)
}

/// Copies stripe `index` from one of `from` to node `to`, checked against the layout.
#[allow(clippy::too_many_arguments)]
pub(super) async fn copy_stripe(
    cluster: &Cluster,
    share: &str,
    layout: &Layout,
    index: usize,
    len: u64,
    from: &[String],
    to: &str,
    scratch: &Path,
) -> Result<(), ClientError> {
    let object = layout.object_path(share, index);
    let want = layout
        .manifest(index)
        .ok_or_else(|| ClientError::Cluster("bad manifest in the layout".into()))?;
    let target = cluster.session(to).await?;
    if target.negotiated().is_some_and(|n| n.cluster) {
        return replicate(cluster, &target, (from, to), &object, len, want).await;
    }
    let local: PathBuf = scratch.join(format!("ferry-repair-{}-{index}", layout.id));
    fetch_stripe(
        cluster,
        from,
        &object,
        &local,
        len,
        (layout.algorithm, want),
    )
    .await?;
    let (object, local) = (&object, &local);
    let put = |p: Progress| async move {
        let c = cluster.session(to).await?;
        p.attach(&c);
        cluster.object_dir(to, &c, object).await?;
        let progress = p.wrap(no_progress());
        transfer::upload_range(&c, local, 0..len, STORE_SHARE, object, progress).await
    };
    let up = cluster.watched(to, put).await;
    let _ = std::fs::remove_file(local);
    let up = up?;
    if up.manifest != want {
        return Err(ClientError::Integrity {
            what: format!("node {to}: {object}"),
            chunk: 0,
        });
    }
    Ok(())
}

/// Has node `to` (its session `target`, of the `cluster` capability) fetch stripe
/// `object` from one of `from` itself, node to node, checked against `want`.
async fn replicate(
    cluster: &Cluster,
    target: &Client,
    (from, to): (&[String], &str),
    object: &str,
    len: u64,
    want: Hash256,
) -> Result<(), ClientError> {
    let mut last = None;
    for node in from {
        let Some(addr) = cluster.addr_of(node) else {
            continue;
        };
        // Under the progress deadline: the new holder answers probes while it
        // fetches; one that hangs is suspect and the next node is tried.
        let copy = |p: Progress| {
            p.attach(target);
            target.replicate(STORE_SHARE, object, &addr, len, want)
        };
        match cluster.watched(to, copy).await {
            Ok(()) => return Ok(()),
            Err(e) => {
                tracing::warn!(from = node, to, object, "node-to-node copy failed: {e}");
                last = Some(e);
            }
        }
    }
    Err(last.unwrap_or_else(|| ClientError::Cluster("no live replica".into())))
}

/// Fetches stripe `object` (`len` bytes) from one of `from` into the scratch file
/// `local`, checked against the layout's `algorithm` and manifest `want`.
async fn fetch_stripe(
    cluster: &Cluster,
    from: &[String],
    object: &str,
    local: &Path,
    len: u64,
    (algorithm, want): (HashAlgorithm, Hash256),
) -> Result<(), ClientError> {
    let mut last = None;
    for node in from {
        let fetch = |p: Progress| async move {
            let c = cluster.session(node).await?;
            p.attach(&c);
            let asm = Assembly::open(
                local,
                len,
                c.welcome().chunk_bytes,
                algorithm,
                rand::random(),
            )
            .await?;
            let progress = p.wrap(no_progress());
            let got = transfer::download_range(
                &c,
                STORE_SHARE,
                object,
                transfer::Part::Assembly(&asm),
                0,
                len,
                progress,
            )
            .await;
            match got {
                Ok(g) if g.manifest == want && g.algorithm == algorithm => {
                    asm.finish(0o600, ferry_common::msg::Timestamp::default())
                        .await
                }
                Ok(_) => {
                    asm.discard();
                    Err(ClientError::Integrity {
                        what: format!("node {node}: {object}"),
                        chunk: 0,
                    })
                }
                Err(e) => {
                    asm.discard();
                    Err(e)
                }
            }
        };
        match cluster.watched(node, fetch).await {
            Ok(()) => return Ok(()),
            Err(e) => last = Some(e),
        }
    }
    Err(last.unwrap_or_else(|| ClientError::Cluster("no live replica".into())))
}
