//! `ferry cluster status`: the nodes, their space, and the health of every stripe.

use std::collections::HashMap;

use crate::model::{EntryKind, NodeInfo};
use serde::Serialize;

use super::Cluster;
use ferry_client::error::ClientError;

/// One node as `status` shows it.
#[derive(Debug, Clone, Serialize)]
pub struct NodeStatus {
    /// Its id.
    pub id: String,
    /// Its address.
    pub addr: String,
    /// Registered now (its lease is current).
    pub live: bool,
    /// Transports it serves.
    pub transports: Vec<String>,
    /// Bytes of its store's file system.
    pub capacity: u64,
    /// Bytes free there.
    pub free: u64,
    /// Bytes it keeps free (`ferryd --min-free`).
    pub reserve: u64,
    /// No room above its reserve: it gets no new stripes.
    pub full: bool,
    /// Marked draining (`ferry cluster drain`): it gets no new stripes.
    pub draining: bool,
    /// Stripe replicas that layouts place on it.
    pub stripes: u64,
}

impl NodeStatus {
    /// Node `now` (its current registration, or its last one) as `status` shows it.
    fn new(now: &NodeInfo, live: bool, draining: bool, stripes: u64) -> NodeStatus {
        NodeStatus {
            id: now.id.clone(),
            addr: now.addr.clone(),
            live,
            transports: now.transports.clone(),
            capacity: now.capacity,
            free: now.free,
            reserve: now.reserve,
            full: now.is_full(),
            draining,
            stripes,
        }
    }

    /// One word for the STATE column: DOWN, DRAINING, FULL or up.
    pub fn state(&self) -> &'static str {
        match (self.live, self.draining, self.full) {
            (false, _, _) => "DOWN",
            (true, true, _) => "DRAINING",
            (true, false, true) => "FULL",
            (true, false, false) => "up",
        }
    }
}

/// The whole cluster.
#[derive(Debug, Clone, Serialize)]
pub struct Status {
    /// Every node that registered, live or not.
    pub nodes: Vec<NodeStatus>,
    /// Capacity of the live nodes.
    pub capacity: u64,
    /// Free space on the live nodes.
    pub free: u64,
    /// Used space on the live nodes.
    pub used: u64,
    /// Shares and their settings.
    pub shares: Vec<ShareStatus>,
    /// Files in every share.
    pub files: u64,
    /// Stripes of those files.
    pub stripes: u64,
    /// Stripes with fewer live replicas than their share asks for (`repair` fixes).
    pub under_replicated: u64,
    /// Stripes with no live replica at all (unreadable until a node comes back).
    pub unavailable: u64,
}

/// A share's settings.
#[derive(Debug, Clone, Serialize)]
pub struct ShareStatus {
    /// Its name.
    pub name: String,
    /// Replicas per stripe.
    pub replicas: u8,
    /// Bytes per stripe.
    pub stripe_bytes: u64,
}

/// Reads the cluster's state from etcd.
pub async fn status(cluster: &Cluster) -> Result<Status, ClientError> {
    let live = cluster.refresh_nodes().await?;
    let members = cluster.meta().members().await?;
    let shares = cluster.meta().shares().await?;
    let want: HashMap<String, usize> = shares
        .iter()
        .map(|(n, c)| (n.clone(), usize::from(c.replicas)))
        .collect();
    let live_ids: HashMap<&str, &NodeInfo> = live.iter().map(|n| (n.id.as_str(), n)).collect();
    let mut per_node: HashMap<String, u64> = HashMap::new();
    let (mut files, mut stripes, mut under, mut unavailable) = (0, 0, 0, 0);
    for (share, _, v) in cluster.meta().all_entries().await? {
        if v.entry.kind != EntryKind::File {
            continue;
        }
        files += 1;
        let Some(layout) = &v.entry.layout else {
            continue;
        };
        let target = want
            .get(&share)
            .copied()
            .unwrap_or(1)
            .min(live.len().max(1));
        for s in &layout.stripes {
            stripes += 1;
            let alive = s
                .replicas
                .iter()
                .filter(|r| live_ids.contains_key(r.as_str()))
                .count();
            for r in &s.replicas {
                *per_node.entry(r.clone()).or_default() += 1;
            }
            if alive == 0 {
                unavailable += 1;
            } else if alive < target {
                under += 1;
            }
        }
    }
    let draining = cluster.draining();
    let show = |now: &NodeInfo, live: bool| {
        let stripes = per_node.get(&now.id).copied().unwrap_or(0);
        NodeStatus::new(now, live, draining.contains(&now.id), stripes)
    };
    let mut nodes: Vec<NodeStatus> = members
        .iter()
        .map(|m| match live_ids.get(m.id.as_str()) {
            Some(now) => show(now, true),
            None => show(m, false),
        })
        .collect();
    // A live node whose membership record is missing (registered by an older build).
    for n in &live {
        if !nodes.iter().any(|s| s.id == n.id) {
            nodes.push(show(n, true));
        }
    }
    let capacity = live.iter().map(|n| n.capacity).sum();
    let free = live.iter().map(|n| n.free).sum();
    Ok(Status {
        nodes,
        capacity,
        free,
        used: capacity - free.min(capacity),
        shares: shares
            .into_iter()
            .map(|(name, c)| ShareStatus {
                name,
                replicas: c.replicas,
                stripe_bytes: c.stripe_bytes,
            })
            .collect(),
        files,
        stripes,
        under_replicated: under,
        unavailable,
    })
}
