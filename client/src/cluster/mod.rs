//! Cluster shares: files striped and replicated over storage nodes, their namespace
//! and layouts in etcd (the model: [`ferry_common::cluster`]).
//!
//! - [`meta`]: the etcd side (nodes, shares, entries, compare-and-swap commits), over
//!   a connection made from an [`EtcdConfig`] ([`etcd_config`]: endpoints, TLS, user;
//!   from options and the cluster configuration file) by [`etcd_connect`], which also
//!   says why etcd refused one; [`auth_setup`]: turning on etcd's authentication with
//!   Ferry's roles.
//! - [`Cluster`] (here): a client's view of one cluster: etcd, the live nodes, and one
//!   ferryd session per node, opened when first needed.
//! - [`files`]: one file up ([`Cluster::put_file`]: stripes to their nodes in parallel,
//!   then the entry in one transaction) and down ([`Cluster::get_file`]: stripes from
//!   any live replica, each checked against the layout's manifest).
//! - [`copy`]: `rcp` on cluster shares: files and trees, up and down.
//! - [`repair`]: re-replicating under-replicated stripes node to node, and
//!   [`status`]: the nodes and the stripes' health.
//! - [`member`]: a node's registration under its lease (ferryd's side).

pub mod auth_setup;
pub mod backup;
pub mod copy;
pub mod etcd_config;
pub mod etcd_connect;
pub mod files;
pub mod member;
pub mod meta;
pub mod repair;
pub mod status;

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};

use ferry_common::cluster::{NodeInfo, STORE_SHARE};
use ferry_common::transport::TransportChoice;

use crate::client::{Client, Credentials};
use crate::error::ClientError;
pub use etcd_config::{EtcdArgs, EtcdConfig};
pub use etcd_connect::EtcdError;
pub use meta::Meta;

/// Default etcd client port.
pub const DEFAULT_ETCD_PORT: u16 = 2379;

/// A client's handle on a cluster.
#[derive(Clone)]
pub struct Cluster {
    inner: Arc<Inner>,
}

struct Inner {
    meta: Meta,
    transport: TransportChoice,
    credentials: Credentials,
    /// One session per node id, authenticated for the store share.
    sessions: tokio::sync::Mutex<HashMap<String, Client>>,
    /// Nodes that failed an operation in this run: not chosen for new stripes, tried
    /// last for reads.
    failed: Mutex<HashSet<String>>,
    /// The last view of the live nodes.
    nodes: Mutex<Vec<NodeInfo>>,
    /// Object directories known to exist, as (node, directory).
    dirs: Mutex<HashSet<(String, String)>>,
    /// Per node, the permits of the stripe transfers it may have in flight.
    slots: Mutex<HashMap<String, Arc<tokio::sync::Semaphore>>>,
}

/// Stripe transfers in flight per node, over every file of a run: with two windows
/// outstanding each, enough to keep a node's link busy.
pub const STRIPES_PER_NODE: usize = 2;

impl std::fmt::Debug for Cluster {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Cluster")
            .field("meta", &self.inner.meta)
            .finish()
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Splits `HOST:PORT` (or `[V6]:PORT`).
pub fn split_addr(addr: &str) -> Option<(String, u16)> {
    let (host, port) = addr.rsplit_once(':')?;
    let host = host.trim_start_matches('[').trim_end_matches(']');
    Some((host.to_owned(), port.parse().ok()?))
}

impl Cluster {
    /// Connects to the cluster's etcd as `etcd` says; nodes are connected to as they
    /// are needed, over `transport`, proving the store share's secret from
    /// `credentials`.
    pub async fn connect(
        etcd: &EtcdConfig,
        transport: TransportChoice,
        credentials: Credentials,
    ) -> Result<Cluster, ClientError> {
        let meta = Meta::connect(etcd).await?;
        let cluster = Cluster {
            inner: Arc::new(Inner {
                meta,
                transport,
                credentials,
                sessions: tokio::sync::Mutex::new(HashMap::new()),
                failed: Mutex::new(HashSet::new()),
                nodes: Mutex::new(Vec::new()),
                dirs: Mutex::new(HashSet::new()),
                slots: Mutex::new(HashMap::new()),
            }),
        };
        cluster.refresh_nodes().await?;
        Ok(cluster)
    }

    /// The etcd connection.
    pub fn meta(&self) -> &Meta {
        &self.inner.meta
    }

    /// Reads the live nodes again.
    pub async fn refresh_nodes(&self) -> Result<Vec<NodeInfo>, ClientError> {
        let nodes = self.inner.meta.nodes().await?;
        *lock(&self.inner.nodes) = nodes.clone();
        Ok(nodes)
    }

    /// The live nodes as last read, without those that failed in this run.
    pub fn usable_nodes(&self) -> Vec<NodeInfo> {
        let failed = lock(&self.inner.failed).clone();
        lock(&self.inner.nodes)
            .iter()
            .filter(|n| !failed.contains(&n.id))
            .cloned()
            .collect()
    }

    /// The address of live node `id`, as last read.
    pub fn addr_of(&self, id: &str) -> Option<String> {
        lock(&self.inner.nodes)
            .iter()
            .find(|n| n.id == id)
            .map(|n| n.addr.clone())
    }

    /// True if node `id` is registered (its lease is current) as last read.
    pub fn is_live(&self, id: &str) -> bool {
        lock(&self.inner.nodes).iter().any(|n| n.id == id)
    }

    /// Marks node `id` as failed for the rest of this run and drops its session.
    pub async fn mark_failed(&self, id: &str, why: &ClientError) {
        tracing::warn!(node = id, "storage node failed: {why}");
        lock(&self.inner.failed).insert(id.to_owned());
        if let Some(c) = self.inner.sessions.lock().await.remove(id) {
            c.close();
        }
    }

    /// Forgets which nodes failed: a long-lived client (the mount) starts each
    /// operation with every live node usable again.
    pub fn clear_failed(&self) {
        lock(&self.inner.failed).clear();
    }

    /// True if node `id` failed in this run.
    pub fn has_failed(&self, id: &str) -> bool {
        lock(&self.inner.failed).contains(id)
    }

    /// The session with node `id` (opened and authenticated on first use).
    pub async fn session(&self, id: &str) -> Result<Client, ClientError> {
        let mut sessions = self.inner.sessions.lock().await;
        if let Some(c) = sessions.get(id) {
            return Ok(c.clone());
        }
        let node = lock(&self.inner.nodes)
            .iter()
            .find(|n| n.id == id)
            .cloned()
            .ok_or_else(|| ClientError::Cluster(format!("storage node {id} is not alive")))?;
        let (host, port) = split_addr(&node.addr).ok_or_else(|| {
            ClientError::Cluster(format!("storage node {id}: bad address {}", node.addr))
        })?;
        let client = Client::connect_with(
            &host,
            port,
            self.inner.transport,
            self.inner.credentials.clone(),
        )
        .await?;
        client.authenticate(STORE_SHARE).await?;
        sessions.insert(id.to_owned(), client.clone());
        Ok(client)
    }

    /// Makes sure the directory of store object `object` exists on node `id` (with
    /// its parents), once per run.
    pub async fn object_dir(
        &self,
        id: &str,
        client: &Client,
        object: &str,
    ) -> Result<(), ClientError> {
        let Some((dir, _)) = object.rsplit_once('/') else {
            return Ok(());
        };
        let key = (id.to_owned(), dir.to_owned());
        if lock(&self.inner.dirs).contains(&key) {
            return Ok(());
        }
        let mut path = String::new();
        for part in dir.split('/') {
            if !path.is_empty() {
                path.push('/');
            }
            path.push_str(part);
            client.mkdir(STORE_SHARE, &path, 0o700, true).await?;
        }
        lock(&self.inner.dirs).insert(key);
        Ok(())
    }

    /// The stripe-transfer permits of node `id` ([`STRIPES_PER_NODE`]).
    pub fn node_slots(&self, id: &str) -> Arc<tokio::sync::Semaphore> {
        lock(&self.inner.slots)
            .entry(id.to_owned())
            .or_insert_with(|| Arc::new(tokio::sync::Semaphore::new(STRIPES_PER_NODE)))
            .clone()
    }

    /// Any open session, to describe the link (transport, cipher, hash).
    pub async fn any_session(&self) -> Option<Client> {
        self.inner.sessions.lock().await.values().next().cloned()
    }

    /// Closes every node session.
    pub async fn close(&self) {
        for (_, c) in self.inner.sessions.lock().await.drain() {
            c.close();
        }
    }
}
