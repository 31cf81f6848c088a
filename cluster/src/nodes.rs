//! The node set: one view per process of the cluster's storage nodes (live, draining,
//! suspect), read from the process's one etcd connection ([`Meta`]) and judged by its
//! one failure policy ([`Health`]).
//!
//! Every user of the cluster in a process shares one [`NodeSet`]: `rcp` and `ferry`
//! through their [`crate::Cluster`]; a mount's readers (`ferry-mount`'s stripe reads)
//! and its writer (a [`crate::Cluster`] made [`crate::Cluster::over`] the same set). So
//! a node one of them found hung is read last and placed on last by all of them, and a
//! node that registered is seen by all of them at the next refresh.
//!
//! Invariants: the view changes only as a whole (the live nodes and the draining
//! marks of one refresh, read together); a refresh that fails keeps the last view
//! (a reader goes on with the nodes it knew, and the failure is the caller's to
//! report); one refresh runs at a time, and callers that wait for it see its result.

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use ferry_client::ClientError;

use crate::health::Health;
use crate::model::NodeInfo;
use crate::{lock, Meta};

/// The storage nodes as last read, with when.
#[derive(Default)]
struct View {
    nodes: Vec<NodeInfo>,
    draining: BTreeSet<String>,
    refreshed: Option<Instant>,
}

/// A process's view of the cluster's storage nodes.
pub struct NodeSet {
    meta: Meta,
    health: Arc<Health>,
    view: Mutex<View>,
    refreshing: tokio::sync::Mutex<()>,
}

impl std::fmt::Debug for NodeSet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NodeSet").field("meta", &self.meta).finish()
    }
}

impl NodeSet {
    /// The nodes registered in `meta`'s etcd, judged by `health`; nothing read yet.
    pub fn new(meta: Meta, health: Arc<Health>) -> Arc<NodeSet> {
        Arc::new(NodeSet {
            meta,
            health,
            view: Mutex::new(View::default()),
            refreshing: tokio::sync::Mutex::new(()),
        })
    }

    /// The etcd connection.
    pub fn meta(&self) -> &Meta {
        &self.meta
    }

    /// The node-health policy and the nodes suspect lately.
    pub fn health(&self) -> &Arc<Health> {
        &self.health
    }

    /// Reads the live nodes and the draining marks again, within `bound` if given
    /// (an etcd that does not answer in time is an error; the last view stays).
    pub async fn refresh_within(
        &self,
        bound: Option<Duration>,
    ) -> Result<Vec<NodeInfo>, ClientError> {
        let _one = self.refreshing.lock().await;
        let read = async {
            let nodes = self.meta.nodes().await?;
            let draining = self.meta.draining().await?;
            Ok::<_, ClientError>((nodes, draining))
        };
        let got = match bound {
            Some(bound) => tokio::time::timeout(bound, read).await.map_err(|_| {
                ClientError::Cluster(format!("storage nodes: etcd did not answer in {bound:?}"))
            })?,
            None => read.await,
        };
        let mut view = lock(&self.view);
        view.refreshed = Some(Instant::now());
        let (nodes, draining) = got?;
        view.nodes = nodes.clone();
        view.draining = draining;
        Ok(nodes)
    }

    /// Reads the live nodes and the draining marks again.
    pub async fn refresh(&self) -> Result<Vec<NodeInfo>, ClientError> {
        self.refresh_within(None).await
    }

    /// Reads the nodes again if the view is older than `ttl` (or was never read),
    /// within `bound`; if etcd cannot answer, the last view stays.
    pub async fn fresh(&self, ttl: Duration, bound: Duration) {
        let due = lock(&self.view)
            .refreshed
            .is_none_or(|at| at.elapsed() >= ttl);
        if due {
            if let Err(e) = self.refresh_within(Some(bound)).await {
                tracing::debug!("keeping the last view of the nodes: {e}");
            }
        }
    }

    /// The live nodes as last read.
    pub fn live(&self) -> Vec<NodeInfo> {
        lock(&self.view).nodes.clone()
    }

    /// The live nodes as last read that may get new stripes: neither suspect nor
    /// draining.
    pub fn usable(&self) -> Vec<NodeInfo> {
        let now = Instant::now();
        let view = lock(&self.view);
        view.nodes
            .iter()
            .filter(|n| !self.health.is_suspect(&n.id, now) && !view.draining.contains(&n.id))
            .cloned()
            .collect()
    }

    /// The nodes marked draining, as last read.
    pub fn draining(&self) -> BTreeSet<String> {
        lock(&self.view).draining.clone()
    }

    /// The address of live node `id`, as last read.
    pub fn addr_of(&self, id: &str) -> Option<String> {
        lock(&self.view)
            .nodes
            .iter()
            .find(|n| n.id == id)
            .map(|n| n.addr.clone())
    }

    /// True if node `id` is registered (its lease is current) as last read.
    pub fn is_live(&self, id: &str) -> bool {
        lock(&self.view).nodes.iter().any(|n| n.id == id)
    }

    /// The order to read `replicas` in now ([`Health::read_order`]).
    pub fn read_order(&self, replicas: &[String]) -> Vec<String> {
        let view = lock(&self.view);
        self.health.read_order(
            replicas,
            |n| view.nodes.iter().any(|v| v.id == n),
            Instant::now(),
        )
    }

    /// Node `id` failed or stalled (`why`): it is suspect ([`Health::suspect`]).
    pub fn suspect(&self, id: &str, why: &str) {
        self.health.suspect(id, why, Instant::now());
    }

    /// True if node `id` is suspect now.
    pub fn is_suspect(&self, id: &str) -> bool {
        self.health.is_suspect(id, Instant::now())
    }
}
