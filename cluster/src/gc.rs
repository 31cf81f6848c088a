//! `ferry cluster gc`: removes the stripe objects no layout names, once they are older
//! than a grace period (the rules and the invariant: [`crate::model::gc`]).
//!
//! The steps, in this order (the order is part of the safety argument):
//!
//! 1. `now` is read;
//! 2. every live node's store share is listed over its ordinary session (`ListDir`
//!    of `SHARE/FAN/`), each object with its size and last change;
//! 3. the whole namespace is read from etcd (every entry of every share, visible or
//!    not: the files, the snapshots, and the snapshots still being built);
//! 4. the pure decision picks the garbage; each object is stat'ed again just before
//!    it is removed (`Remove`), and left if it changed since the listing (a resumed
//!    copy refreshed it to reuse it).
//!
//! An object written after step 2 is not seen; one whose layout was committed before
//! step 3 is named; the others are kept while younger than the grace period, which
//! is what covers an upload in flight. A node that is down is reported, its objects
//! left for a later run; a node that fails is reported and the others go on.

use std::collections::BTreeSet;
use std::time::{Duration, SystemTime};

use crate::model::gc::{verdict, Found, Named, Verdict};
use crate::model::{valid_share_name, STORE_SHARE};
use ferry_common::msg::{Attr, ErrorKind, FileKind, Timestamp};
use serde::Serialize;

use super::health::Progress;
use super::Cluster;
use crate::Client;
use ferry_client::error::ClientError;

/// The grace period unless told otherwise: far longer than any upload takes between
/// writing its first object and committing its layout.
pub const DEFAULT_GRACE: Duration = Duration::from_secs(24 * 3600);

/// A count of objects and their bytes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct Tally {
    /// Objects.
    pub objects: u64,
    /// Their bytes.
    pub bytes: u64,
}

impl Tally {
    fn add(&mut self, bytes: u64) {
        self.objects += 1;
        self.bytes += bytes;
    }

    fn sum(&mut self, other: Tally) {
        self.objects += other.objects;
        self.bytes += other.bytes;
    }
}

/// What gc saw and did on one node.
#[derive(Debug, Clone, Default, Serialize)]
pub struct NodeGc {
    /// The node's id.
    pub id: String,
    /// `up` (listed), `down` (not registered: not looked at) or `failed` (see `error`).
    pub state: &'static str,
    /// Why the node failed, if it did.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// Every object found on it.
    pub found: Tally,
    /// Objects kept: named by a layout, or younger than the grace period.
    pub kept: Tally,
    /// Of those kept, the ones named by no layout (within the grace period).
    pub young: Tally,
    /// Objects removed (with `--dry-run`: that would be removed).
    pub removed: Tally,
    /// Their paths in the store share.
    pub removed_objects: Vec<String>,
}

/// What a gc run did.
#[derive(Debug, Clone, Default, Serialize)]
pub struct GcReport {
    /// True if nothing was removed (the report says what would have been).
    pub dry_run: bool,
    /// The grace period, in seconds.
    pub grace_secs: u64,
    /// Per node.
    pub nodes: Vec<NodeGc>,
    /// Over every node listed.
    pub found: Tally,
    /// Over every node listed.
    pub kept: Tally,
    /// Over every node listed.
    pub young: Tally,
    /// Over every node listed.
    pub removed: Tally,
    /// Nodes down (not looked at).
    pub down: Vec<String>,
    /// What failed: a node that could not be listed, an object that could not be
    /// removed.
    pub failed: Vec<String>,
}

/// Runs gc over every node of the cluster (see the module's steps).
pub async fn gc(
    cluster: &Cluster,
    grace: Duration,
    dry_run: bool,
) -> Result<GcReport, ClientError> {
    let now = Timestamp::from_system(SystemTime::now());
    let live = cluster.refresh_nodes().await?;
    let ids: BTreeSet<String> = cluster
        .meta()
        .members()
        .await?
        .into_iter()
        .chain(live)
        .map(|n| n.id)
        .collect();
    let mut report = GcReport {
        dry_run,
        grace_secs: grace.as_secs(),
        ..GcReport::default()
    };
    let mut listed = Vec::new();
    for id in ids {
        if !cluster.is_live(&id) {
            report.down.push(id.clone());
            report.nodes.push(NodeGc {
                id,
                state: "down",
                ..NodeGc::default()
            });
            continue;
        }
        match cluster.watched(&id, |p| list_node(cluster, &id, p)).await {
            Ok(found) => listed.push((id, found)),
            Err(e) => {
                report
                    .failed
                    .push(format!("node {id}: cannot list its objects: {e}"));
                report.nodes.push(NodeGc {
                    id,
                    state: "failed",
                    error: Some(e.to_string()),
                    ..NodeGc::default()
                });
            }
        }
    }
    // Read only now, after every listing: see the module's steps.
    let named = named(cluster).await?;
    for (id, found) in listed {
        let node = collect_node(cluster, &id, &found, (&named, grace, now), dry_run).await;
        report
            .failed
            .extend(node.error.iter().map(|e| format!("node {id}: {e}")));
        report.found.sum(node.found);
        report.kept.sum(node.kept);
        report.young.sum(node.young);
        report.removed.sum(node.removed);
        report.nodes.push(node);
    }
    report.nodes.sort_by(|a, b| a.id.cmp(&b.id));
    Ok(report)
}

/// Every (node, object) a layout of the namespace names.
async fn named(cluster: &Cluster) -> Result<Named, ClientError> {
    let mut named = Named::new();
    for (share, _, v) in cluster.meta().all_entries().await? {
        if let Some(layout) = &v.entry.layout {
            named.add(&share, layout);
        }
    }
    Ok(named)
}

/// The last change of an object on its node: its ctime, which every change moves to
/// the node's now and no client can set (an object's mtime is its source file's).
fn changed(attr: &Attr) -> Timestamp {
    attr.ctime
}

/// The regular files two levels below each share directory of node `id`'s store
/// (`SHARE/FAN/NAME`): the candidates, whatever their names (the decision leaves
/// what is not an object's path).
async fn list_node(cluster: &Cluster, id: &str, p: Progress) -> Result<Vec<Found>, ClientError> {
    let c = cluster.session(id).await?;
    p.attach(&c);
    let mut found = Vec::new();
    for share in subdirs(&c, "").await? {
        if !valid_share_name(&share) {
            continue;
        }
        for fan in subdirs(&c, &share).await? {
            let dir = format!("{share}/{fan}");
            for e in c.list_dir(STORE_SHARE, &dir).await? {
                if e.attr.kind == FileKind::File {
                    found.push(Found {
                        path: format!("{dir}/{}", e.name),
                        size: e.attr.size,
                        changed: changed(&e.attr),
                    });
                }
            }
        }
    }
    Ok(found)
}

/// The names of the directories in `dir` of the store share.
async fn subdirs(c: &Client, dir: &str) -> Result<Vec<String>, ClientError> {
    Ok(c.list_dir(STORE_SHARE, dir)
        .await?
        .into_iter()
        .filter(|e| e.attr.kind == FileKind::Dir)
        .map(|e| e.name)
        .collect())
}

/// Decides about every object `found` on node `id` and removes the garbage (unless
/// `dry_run`).
async fn collect_node(
    cluster: &Cluster,
    id: &str,
    found: &[Found],
    (named, grace, now): (&Named, Duration, Timestamp),
    dry_run: bool,
) -> NodeGc {
    let mut node = NodeGc {
        id: id.to_owned(),
        state: "up",
        ..NodeGc::default()
    };
    for f in found {
        let v = verdict(id, f, named, grace, now);
        if v == Verdict::Foreign {
            continue;
        }
        node.found.add(f.size);
        if v == Verdict::Garbage && !dry_run {
            match cluster
                .watched(id, |p| remove_if_unchanged(cluster, id, f, p))
                .await
            {
                Ok(true) => {}
                Ok(false) => {
                    node.kept.add(f.size);
                    node.young.add(f.size);
                    continue;
                }
                Err(e) => {
                    node.kept.add(f.size);
                    let why = format!("cannot remove {}: {e}", f.path);
                    node.error.get_or_insert(why);
                    continue;
                }
            }
        }
        match v {
            Verdict::Garbage => {
                node.removed.add(f.size);
                node.removed_objects.push(f.path.clone());
            }
            Verdict::Young => {
                node.kept.add(f.size);
                node.young.add(f.size);
            }
            _ => node.kept.add(f.size),
        }
    }
    node
}

/// Removes object `f` from node `id` if it has not changed since it was listed: true
/// if it is gone (removed now, or by someone else meanwhile), false if it changed
/// (a resumed copy refreshed it to reuse it) and stays.
async fn remove_if_unchanged(
    cluster: &Cluster,
    id: &str,
    f: &Found,
    p: Progress,
) -> Result<bool, ClientError> {
    let c = cluster.session(id).await?;
    p.attach(&c);
    let gone = |e: &ClientError| e.remote_kind() == Some(ErrorKind::NotFound);
    match c.stat(STORE_SHARE, &f.path, false).await {
        Ok(attr) if changed(&attr) != f.changed => return Ok(false),
        Ok(_) => {}
        Err(e) if gone(&e) => return Ok(true),
        Err(e) => return Err(e),
    }
    match c.remove(STORE_SHARE, &f.path, false).await {
        Err(e) if !gone(&e) => Err(e),
        _ => Ok(true),
    }
}
