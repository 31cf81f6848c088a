//! ferryd as a cluster storage node: its registration in etcd, kept alive.

use std::path::PathBuf;

use ferry_client::cluster::{member, EtcdConfig};
use ferry_common::cluster::NodeInfo;

/// Size and free bytes of the file system holding `store`.
fn space(store: &std::path::Path) -> (u64, u64) {
    match nix::sys::statvfs::statvfs(store) {
        Ok(s) => {
            let frag = s.fragment_size();
            (s.blocks() * frag, s.blocks_available() * frag)
        }
        Err(e) => {
            tracing::warn!(store = %store.display(), "cannot read the store's free space: {e}");
            (0, 0)
        }
    }
}

/// Registers this node and keeps it registered, for as long as ferryd runs.
pub async fn join(
    etcd: EtcdConfig,
    id: String,
    addr: String,
    transports: Vec<String>,
    store: PathBuf,
    ttl: i64,
) {
    let started = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs() as i64);
    let info = move || {
        let (capacity, free) = space(&store);
        NodeInfo {
            id: id.clone(),
            addr: addr.clone(),
            transports: transports.clone(),
            capacity,
            free,
            started,
        }
    };
    member::keep_registered(etcd, ttl, info, |node, lease| {
        tracing::info!(
            node = %node.id,
            addr = %node.addr,
            lease = format!("{lease:x}"),
            "registered in the cluster"
        );
    })
    .await;
}
