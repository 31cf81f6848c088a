//! `ferry cluster drain` and `ferry cluster rebalance`: stripe replicas moved from node
//! to node, planned by [`crate::model::balance`] and moved with repair's copy.
//!
//! A move of stripe `i` of a layout from node A to node B: B fetches the object from A
//! (or another live holder) node to node and checks it against the layout's manifest
//! ([`repair::copy_stripe`]); once every move of a file is copied, the file's entry is
//! updated by one compare-and-swap with B in A's place. A file rewritten meanwhile
//! keeps its new version (the swap fails; its new layout was placed without a draining
//! node, and a drain's next pass or the next rebalance looks at it again). A's copy is
//! never deleted here: once no layout names it, `ferry cluster gc` collects it after
//! its grace period, so a reader that read the old layout still finds it.
//!
//! A drain first marks the node draining in etcd ([`Meta::set_draining`]): from then on
//! no client places new stripes there. It is resumable and idempotent: each pass plans
//! from what etcd holds now, so a second run moves only what the first left.
//!
//! [`Meta::set_draining`]: super::Meta::set_draining

use std::collections::BTreeMap;
use std::path::Path;

use crate::model::balance::{self, Move, Replicas};
use crate::model::{stripe_range, EntryKind};
use serde::Serialize;

use super::meta::{Commit, Versioned};
use super::{repair, Cluster};
use ferry_client::error::ClientError;

/// Passes a drain makes over the namespace: files written while the drain began (by
/// a client that had not seen the mark yet) are picked up by the next pass.
const DRAIN_PASSES: usize = 3;

/// Every file with a layout, and its stripes as the planners see them
/// ([`Replicas::entry`] indexes `files`).
struct Scan {
    files: Vec<(String, String, Versioned)>,
    stripes: Vec<Replicas>,
}

/// Reads every layout of every share (files and snapshots).
async fn scan(cluster: &Cluster) -> Result<Scan, ClientError> {
    let mut files = Vec::new();
    let mut stripes = Vec::new();
    for (share, path, v) in cluster.meta().all_entries().await? {
        let Some(layout) = v
            .entry
            .layout
            .as_ref()
            .filter(|_| v.entry.kind == EntryKind::File)
        else {
            continue;
        };
        for (i, s) in layout.stripes.iter().enumerate() {
            let r = stripe_range(v.entry.size, layout.stripe_bytes, i);
            stripes.push(Replicas {
                entry: files.len(),
                key: layout.id.clone(),
                stripe: i,
                replicas: s.replicas.clone(),
                len: r.end - r.start,
            });
        }
        files.push((share, path, v));
    }
    Ok(Scan { files, stripes })
}

/// One move, as reports show it.
#[derive(Debug, Clone, Serialize)]
pub struct MoveView {
    /// The file's share.
    pub share: String,
    /// The file's path.
    pub path: String,
    /// The stripe's index.
    pub stripe: usize,
    /// The node giving up its replica.
    pub from: String,
    /// The node getting one.
    pub to: String,
    /// Bytes copied.
    pub bytes: u64,
}

/// What moves did.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Moved {
    /// Replicas moved (copied, and committed in their layout).
    pub stripes_moved: u64,
    /// Bytes of those.
    pub bytes_moved: u64,
    /// Moves that failed or whose file changed meanwhile, and why.
    pub failed: Vec<String>,
}

/// Copies and commits `moves` (planned over `scan`), one compare-and-swap per file.
async fn apply(cluster: &Cluster, scan: &Scan, moves: &[Move], scratch: &Path, out: &mut Moved) {
    let mut by_file: BTreeMap<usize, Vec<&Move>> = BTreeMap::new();
    for m in moves {
        by_file.entry(m.entry).or_default().push(m);
    }
    for (entry, moves) in by_file {
        let (share, path, v) = &scan.files[entry];
        let Some(mut layout) = v.entry.layout.clone() else {
            continue;
        };
        let (mut stripes, mut bytes) = (0, 0);
        for m in moves {
            let replicas = &layout.stripes[m.stripe].replicas;
            // The replica being given up first (it is live while it drains), then the
            // other live holders.
            let mut from: Vec<String> = vec![m.from.clone()];
            from.extend(replicas.iter().filter(|r| **r != m.from).cloned());
            from.retain(|r| cluster.is_live(r));
            let copied = repair::copy_stripe(
                cluster, share, &layout, m.stripe, m.len, &from, &m.to, scratch,
            )
            .await;
            match copied {
                Ok(()) => {
                    for r in layout.stripes[m.stripe].replicas.iter_mut() {
                        if *r == m.from {
                            r.clone_from(&m.to);
                        }
                    }
                    stripes += 1;
                    bytes += m.len;
                }
                Err(e) => out.failed.push(format!(
                    "{share}/{path} stripe {} from {} to {}: {e}",
                    m.stripe, m.from, m.to
                )),
            }
        }
        if stripes == 0 {
            continue;
        }
        let mut new = v.entry.clone();
        new.layout = Some(layout);
        // Without the parent check: the swap only replaces this very version (a
        // snapshot's entries may sit below a root not published yet).
        match cluster
            .meta()
            .commit_with(share, path, &new, v.revision, false)
            .await
        {
            Ok(Commit::Done(_)) => {
                out.stripes_moved += stripes;
                out.bytes_moved += bytes;
            }
            Ok(Commit::Conflict) => out.failed.push(format!(
                "{share}/{path}: changed during the move (its new version is kept); run it again"
            )),
            Err(e) => out.failed.push(format!("{share}/{path}: {e}")),
        }
    }
}

/// What a drain did.
#[derive(Debug, Clone, Default, Serialize)]
pub struct DrainReport {
    /// The node drained.
    pub node: String,
    /// Passes made over the namespace.
    pub passes: usize,
    /// The moves.
    #[serde(flatten)]
    pub moved: Moved,
    /// Replicas still on the node: stripes no other node could take (every live node
    /// holds them or is full), copies that failed, files changed meanwhile.
    pub remaining: u64,
}

/// Drains node `node`: marks it draining, then moves every replica it holds to other
/// nodes (see the module's steps); `scratch` as for [`repair::repair`].
pub async fn drain(
    cluster: &Cluster,
    node: &str,
    scratch: &Path,
) -> Result<DrainReport, ClientError> {
    known_node(cluster, node).await?;
    cluster.meta().set_draining(node, true).await?;
    let mut report = DrainReport {
        node: node.to_owned(),
        ..DrainReport::default()
    };
    loop {
        cluster.refresh_nodes().await?;
        let scan = scan(cluster).await?;
        let plan = balance::plan_drain(node, &scan.stripes, &cluster.usable_nodes());
        report.remaining = (plan.moves.len() + plan.stuck.len()) as u64;
        if plan.moves.is_empty() || report.passes == DRAIN_PASSES {
            for (entry, stripe) in plan.stuck {
                let (share, path, _) = &scan.files[entry];
                report.moved.failed.push(format!(
                    "{share}/{path} stripe {stripe}: no other live node without a copy has room"
                ));
            }
            return Ok(report);
        }
        report.passes += 1;
        apply(cluster, &scan, &plan.moves, scratch, &mut report.moved).await;
    }
}

/// Clears node `node`'s draining mark: it gets new stripes again.
pub async fn undrain(cluster: &Cluster, node: &str) -> Result<(), ClientError> {
    known_node(cluster, node).await?;
    cluster.meta().set_draining(node, false).await
}

/// Fails unless `node` is a node of the cluster (registered now or before).
async fn known_node(cluster: &Cluster, node: &str) -> Result<(), ClientError> {
    let members = cluster.meta().members().await?;
    if members.iter().any(|m| m.id == node) || cluster.is_live(node) {
        Ok(())
    } else {
        Err(ClientError::Usage(format!(
            "{node}: no such node in the cluster (`ferry cluster status` lists them)"
        )))
    }
}

/// What a rebalance did (or, with `dry_run`, would do).
#[derive(Debug, Clone, Default, Serialize)]
pub struct RebalanceReport {
    /// Nothing was moved: `plan` is what a run would do.
    pub dry_run: bool,
    /// The tolerance, in percent of the mean replica count per node.
    pub tolerance_percent: u32,
    /// The largest difference of replica counts the plan leaves.
    pub allowed_spread: usize,
    /// Replicas per node (live, not draining) before.
    pub before: BTreeMap<String, usize>,
    /// Replicas per node after (as planned, with `dry_run`).
    pub after: BTreeMap<String, usize>,
    /// The moves planned.
    pub plan: Vec<MoveView>,
    /// The moves made.
    #[serde(flatten)]
    pub moved: Moved,
}

/// Moves replicas from the most loaded live nodes to the least until their counts
/// are within `tolerance_percent` of the mean; with `dry_run`, only plans.
pub async fn rebalance(
    cluster: &Cluster,
    tolerance_percent: u32,
    dry_run: bool,
    scratch: &Path,
) -> Result<RebalanceReport, ClientError> {
    cluster.refresh_nodes().await?;
    let nodes = cluster.usable_nodes();
    let scan = scan(cluster).await?;
    let plan = balance::plan_rebalance(&scan.stripes, &nodes, tolerance_percent);
    let before = balance::counts(&scan.stripes, &nodes);
    let mut after = before.clone();
    for m in &plan {
        *after.entry(m.from.clone()).or_default() -= 1;
        *after.entry(m.to.clone()).or_default() += 1;
    }
    let mut report = RebalanceReport {
        dry_run,
        tolerance_percent,
        allowed_spread: balance::allowed_spread(
            before.values().sum(),
            nodes.len(),
            tolerance_percent,
        ),
        before,
        after,
        plan: plan.iter().map(|m| view(&scan, m)).collect(),
        moved: Moved::default(),
    };
    if !dry_run {
        apply(cluster, &scan, &plan, scratch, &mut report.moved).await;
        report.after = balance::counts(&scan_again(cluster).await?, &nodes);
    }
    Ok(report)
}

/// The stripes as etcd holds them now.
async fn scan_again(cluster: &Cluster) -> Result<Vec<Replicas>, ClientError> {
    Ok(scan(cluster).await?.stripes)
}

fn view(scan: &Scan, m: &Move) -> MoveView {
    let (share, path, _) = &scan.files[m.entry];
    MoveView {
        share: share.clone(),
        path: path.clone(),
        stripe: m.stripe,
        from: m.from.clone(),
        to: m.to.clone(),
        bytes: m.len,
    }
}
