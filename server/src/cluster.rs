//! ferryd as a cluster storage node: its registration in etcd, kept alive.

use std::path::PathBuf;

use ferry_cluster::model::NodeInfo;
use std::sync::Arc;

use ferry_cluster::{member, EtcdLink};

/// `--min-free` unless told otherwise.
pub const DEFAULT_MIN_FREE: &str = "2%";

/// The free space a node keeps (`--min-free`): below it the node is full.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MinFree {
    /// A percentage (0 to 100) of the store's file system.
    Percent(u8),
    /// A number of bytes.
    Bytes(u64),
}

impl MinFree {
    /// Parses `2%` or a size (`10G`).
    pub fn parse(arg: &str) -> Result<MinFree, String> {
        match arg.trim().strip_suffix('%') {
            Some(p) => match p.trim().parse::<u8>() {
                Ok(p) if p <= 100 => Ok(MinFree::Percent(p)),
                _ => Err(format!("{arg:?}: a percentage is 0% to 100%")),
            },
            None => ferry_server::config::parse_size(arg)
                .map(MinFree::Bytes)
                .map_err(|e| e.to_string()),
        }
    }

    /// The bytes kept free on a file system of `capacity` bytes.
    pub fn bytes(self, capacity: u64) -> u64 {
        match self {
            MinFree::Percent(p) => capacity / 100 * u64::from(p),
            MinFree::Bytes(b) => b,
        }
    }
}

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

/// Registers this node and keeps it registered, for as long as ferryd runs: its lease
/// of `ttl` seconds, and its space (free, and the `min_free` it keeps) refreshed at
/// each renewal.
pub async fn join(
    etcd: Arc<EtcdLink>,
    id: String,
    addr: String,
    transports: Vec<String>,
    store: PathBuf,
    (ttl, min_free): (i64, MinFree),
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
            reserve: min_free.bytes(capacity),
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn min_free_is_a_percentage_or_a_size() {
        assert_eq!(MinFree::parse("2%"), Ok(MinFree::Percent(2)));
        assert_eq!(MinFree::parse("10G"), Ok(MinFree::Bytes(10 << 30)));
        assert_eq!(MinFree::parse("0"), Ok(MinFree::Bytes(0)));
        assert!(MinFree::parse("101%").is_err());
        assert!(MinFree::parse("x%").is_err());
        assert!(MinFree::parse("lots").is_err());
        assert_eq!(MinFree::Percent(5).bytes(1000), 50);
        assert_eq!(MinFree::Bytes(7).bytes(1000), 7);
        assert_eq!(
            MinFree::parse(DEFAULT_MIN_FREE).unwrap().bytes(100 << 20),
            2 << 20
        );
    }
}
