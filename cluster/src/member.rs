//! A storage node's membership: its [`NodeInfo`] under an etcd lease, kept alive.
//!
//! The registration lives as long as the lease: ferryd renews it every third of its
//! time to live, and a ferryd that dies (or loses etcd for longer than that) drops out
//! of the cluster when the lease expires. Each renewal also refreshes the free space
//! the registration reports. Losing etcd is not fatal to the node: it keeps serving
//! the sessions it has and registers again, under a new lease, once etcd answers.

use std::sync::Arc;
use std::time::Duration;

use crate::model::NodeInfo;

use super::meta::EtcdLink;
use ferry_client::error::ClientError;

/// How long to wait before trying etcd again after it failed.
const RETRY: Duration = Duration::from_secs(1);

/// Keeps node `info()` registered in the etcd of `etcd` (the process's one etcd
/// connection, reset after each failure so the next try connects afresh) with a lease
/// of `ttl_secs`, for ever (until the task is dropped). `info` is called at each
/// renewal for the current free space. `on_registered` is called after each
/// (re-)registration.
pub async fn keep_registered(
    etcd: Arc<EtcdLink>,
    ttl_secs: i64,
    info: impl Fn() -> NodeInfo,
    on_registered: impl Fn(&NodeInfo, i64),
) {
    loop {
        if let Err(e) = register_once(&etcd, ttl_secs, &info, &on_registered).await {
            tracing::warn!("cluster registration: {e}; trying again");
            etcd.reset().await;
        }
        tokio::time::sleep(RETRY).await;
    }
}

async fn register_once(
    link: &EtcdLink,
    ttl_secs: i64,
    info: &impl Fn() -> NodeInfo,
    on_registered: &impl Fn(&NodeInfo, i64),
) -> Result<(), ClientError> {
    let meta = link.get().await?;
    let mut etcd = meta.etcd();
    let etcd_err = |op: &str, e: etcd_client::Error| meta.err(op, e);
    let lease = etcd
        .lease_grant(ttl_secs, None)
        .await
        .map_err(|e| etcd_err("granting a lease", e))?
        .id();
    let mut node = info();
    meta.put_node(&node, lease).await?;
    on_registered(&node, lease);
    let (mut keeper, mut stream) = etcd
        .lease_keep_alive(lease)
        .await
        .map_err(|e| etcd_err("keeping the lease alive", e))?;
    let every = Duration::from_millis((ttl_secs.max(1) as u64) * 1000 / 3);
    loop {
        tokio::time::sleep(every).await;
        keeper
            .keep_alive()
            .await
            .map_err(|e| etcd_err("renewing the lease", e))?;
        match tokio::time::timeout(every.max(Duration::from_secs(1)), stream.message()).await {
            Ok(Ok(Some(r))) if r.ttl() > 0 => {}
            Ok(Ok(_)) => return Err(ClientError::Cluster("etcd: the lease expired".into())),
            Ok(Err(e)) => return Err(etcd_err("renewing the lease", e)),
            Err(_) => return Err(ClientError::Cluster("etcd: no answer to a renewal".into())),
        }
        let now = info();
        if (now.free, now.capacity, now.reserve) != (node.free, node.capacity, node.reserve) {
            meta.put_node(&now, lease).await?;
            node = now;
        }
    }
}
