//! Ferry's cluster engine: files striped and replicated over storage nodes, their
//! namespace and layouts in etcd. One engine for every program: `rcp` and `rcp backup`
//! (through `ferry-cli`), `ferry` (cluster administration), `ferry-mount` (a cluster
//! share mounted) and `ferryd` (a storage node's registration, and the node-to-node
//! fetch of `Replicate`). It is built on `ferry-client`'s sessions and transfers and
//! never on a binary's crate; a process keeps one [`Meta`] (one etcd client) and one
//! [`health::Health`] (one failure policy) whatever it does with the cluster.
//!
//! - [`model`]: the data model with no I/O: keys, entries, layouts, placement, and the
//!   pure planners of gc, drain and rebalance, and of lock tables in etcd.
//! - [`meta`]: the etcd side (nodes, shares, entries, compare-and-swap commits), over
//!   a connection made from an [`EtcdConfig`] ([`etcd_config`]: endpoints, TLS, user;
//!   from options and the cluster configuration file) by [`etcd_connect`], which also
//!   says why etcd refused one; [`auth_setup`]: turning on etcd's authentication with
//!   Ferry's roles.
//! - [`Cluster`] (here): a client's view of one cluster: etcd, the live nodes, and one
//!   ferryd session per node, opened when first needed.
//! - [`files`]: one file up ([`Cluster::put_file`]: stripes to their nodes in parallel,
//!   then the entry in one transaction) and down ([`Cluster::get_file`]: stripes from
//!   any live replica, each checked against the layout's manifest); [`partial`]: a
//!   new version of which only some stripes are local (a mount's staging file, its
//!   stripes fetched as its writes need them), and which objects it may keep.
//! - [`copy`]: `rcp` on cluster shares: files and trees, up and down.
//! - [`nodes`]: the process's one view of the storage nodes ([`NodeSet`]: live,
//!   draining, suspect), shared by every user of the cluster in the process;
//!   [`health`]: its failure policy, the progress deadline every stripe transfer runs
//!   under, and the nodes suspect lately (read last, placed on last, for a while).
//! - [`repair`]: re-replicating under-replicated stripes node to node; [`balance`]:
//!   draining a node and rebalancing, moving replicas with repair's copy; and
//!   [`status`]: the nodes and the stripes' health; [`gc`]: removing the objects
//!   no layout names, once older than a grace period.
//! - [`backup`]: `rcp backup` into a cluster share, and [`snapshots`]: listing and
//!   verifying its snapshots.
//! - [`member`]: a node's registration under its lease (ferryd's side).
//! - [`etcd_snapshot`]: etcd's database saved to a file (`ferry cluster etcd-snapshot`).

#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod auth_setup;
pub mod backup;
pub mod balance;
pub mod copy;
pub mod etcd_config;
pub mod etcd_connect;
pub mod etcd_snapshot;
pub mod files;
pub mod gc;
pub mod health;
pub mod locks;
pub mod member;
pub mod meta;
pub mod model;
pub mod nodes;
pub mod partial;
pub mod repair;
pub mod snapshots;
pub mod status;
pub mod tree_rename;

use std::collections::{BTreeSet, HashMap, HashSet};
use std::future::Future;
use std::sync::{Arc, Mutex};

use crate::model::{NodeInfo, STORE_SHARE};
use ferry_common::transport::TransportChoice;

pub use etcd_config::{EtcdArgs, EtcdConfig};
use ferry_client::client::{Client, Credentials};
use ferry_client::error::ClientError;
pub use ferry_client::etcd_error::{EtcdConfigError, EtcdError};
use health::{Health, Progress};
pub use meta::{EtcdLink, Meta};
pub use nodes::NodeSet;

/// Default etcd client port.
pub const DEFAULT_ETCD_PORT: u16 = 2379;

/// A client's handle on a cluster.
#[derive(Clone)]
pub struct Cluster {
    inner: Arc<Inner>,
}

struct Inner {
    /// The storage nodes (live, draining, suspect) and etcd: shared with every other
    /// user of the cluster in this process.
    nodes: Arc<NodeSet>,
    transport: TransportChoice,
    credentials: Credentials,
    /// One session per node id, authenticated for the store share. A node's session
    /// is dropped when the node is suspected, never reused.
    sessions: tokio::sync::Mutex<HashMap<String, Client>>,
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
            .field("nodes", &self.inner.nodes)
            .finish()
    }
}

/// Locks `m`, taking the value of a poisoned lock as it is (every value these locks
/// guard is whole between statements).
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
        let health = Arc::new(Health::new(health::HealthPolicy::from_env()));
        Cluster::over(NodeSet::new(meta, health), transport, credentials).await
    }

    /// A cluster client over `nodes`, the process's node set (its etcd connection
    /// and failure policy, shared with the process's other users of the cluster: a
    /// mount's readers); the nodes are read again now.
    pub async fn over(
        nodes: Arc<NodeSet>,
        transport: TransportChoice,
        credentials: Credentials,
    ) -> Result<Cluster, ClientError> {
        let credentials = credentials.with_liveness(nodes.health().policy().node_liveness());
        let cluster = Cluster {
            inner: Arc::new(Inner {
                nodes,
                transport,
                credentials,
                sessions: tokio::sync::Mutex::new(HashMap::new()),
                dirs: Mutex::new(HashSet::new()),
                slots: Mutex::new(HashMap::new()),
            }),
        };
        cluster.refresh_nodes().await?;
        Ok(cluster)
    }

    /// The etcd connection.
    pub fn meta(&self) -> &Meta {
        self.inner.nodes.meta()
    }

    /// The node set.
    pub fn nodes(&self) -> &Arc<NodeSet> {
        &self.inner.nodes
    }

    /// Reads the live nodes, and the draining marks, again.
    pub async fn refresh_nodes(&self) -> Result<Vec<NodeInfo>, ClientError> {
        self.inner.nodes.refresh().await
    }

    /// The live nodes as last read that may get new stripes: neither suspect nor
    /// draining.
    pub fn usable_nodes(&self) -> Vec<NodeInfo> {
        self.inner.nodes.usable()
    }

    /// The nodes marked draining, as last read ([`Cluster::refresh_nodes`]).
    pub fn draining(&self) -> BTreeSet<String> {
        self.inner.nodes.draining()
    }

    /// The node-health policy and the nodes suspect lately.
    pub fn health(&self) -> &Arc<Health> {
        self.inner.nodes.health()
    }

    /// Runs `op` on node `id` under the progress deadline ([`health::watch`]); a
    /// stall suspects the node (dropping its session) and fails with
    /// [`ClientError::Stalled`].
    pub async fn watched<T, F, Fut>(&self, id: &str, op: F) -> Result<T, ClientError>
    where
        F: FnOnce(Progress) -> Fut,
        Fut: Future<Output = Result<T, ClientError>>,
    {
        let deadline = self.health().policy().progress_deadline;
        let r = health::watch(id, deadline, op).await;
        if let Err(e @ ClientError::Stalled { .. }) = &r {
            self.suspect(id, e).await;
        }
        r
    }

    /// The address of live node `id`, as last read.
    pub fn addr_of(&self, id: &str) -> Option<String> {
        self.inner.nodes.addr_of(id)
    }

    /// True if node `id` is registered (its lease is current) as last read.
    pub fn is_live(&self, id: &str) -> bool {
        self.inner.nodes.is_live(id)
    }

    /// Marks node `id` suspect ([`health`]) and drops its session: operations still
    /// on it fail, and the next one opens a fresh session.
    pub async fn suspect(&self, id: &str, why: &ClientError) {
        self.inner.nodes.suspect(id, &why.to_string());
        if let Some(c) = self.inner.sessions.lock().await.remove(id) {
            c.close();
        }
    }

    /// True if node `id` is suspect now.
    pub fn is_suspect(&self, id: &str) -> bool {
        self.inner.nodes.is_suspect(id)
    }

    /// The session with node `id` (opened and authenticated on first use, within the
    /// progress deadline: a node that does not answer the handshake is
    /// [`ClientError::Stalled`]). Opening does not hold the table, so a hung node
    /// delays no other node's sessions; of two opened at once, the first kept wins.
    pub async fn session(&self, id: &str) -> Result<Client, ClientError> {
        if let Some(c) = self.inner.sessions.lock().await.get(id) {
            return Ok(c.clone());
        }
        let addr = self
            .addr_of(id)
            .ok_or_else(|| ClientError::Cluster(format!("storage node {id} is not alive")))?;
        let (host, port) = split_addr(&addr).ok_or_else(|| {
            ClientError::Cluster(format!("storage node {id}: bad address {addr}"))
        })?;
        let deadline = self.health().policy().progress_deadline;
        let open = async {
            let client = Client::connect_with(
                &host,
                port,
                self.inner.transport,
                self.inner.credentials.clone(),
            )
            .await?;
            client.authenticate(STORE_SHARE).await?;
            Ok::<_, ClientError>(client)
        };
        let client = match tokio::time::timeout(deadline, open).await {
            Ok(r) => r?,
            Err(_) => {
                return Err(ClientError::Stalled {
                    node: id.to_owned(),
                    after: deadline,
                })
            }
        };
        let mut sessions = self.inner.sessions.lock().await;
        if let Some(kept) = sessions.get(id) {
            client.close();
            return Ok(kept.clone());
        }
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
