//! File data of a cluster mount: the storage nodes, and open files read stripe by
//! stripe from any replica that verifies.
//!
//! Each storage node is reached through a [`Remote`] and a [`Reader`] of its own (a
//! connection, its registered fetch buffers and a verified-chunk cache), the same
//! one-sided read path as a single-server mount. Stripe `i` of an open file is opened
//! on the first node of its replicas that serves it (live nodes that are not suspect
//! first, in the layout's order: the cluster client's one node-health policy,
//! [`ferry_cluster::health`]): the node maps the object, the manifest it
//! sends is read by RDMA READ and checked against the version's manifest hash
//! ([`Reader::open`]), and that hash, the algorithm and the size must then equal what
//! the layout records for the stripe. Every chunk is then checked against those hashes
//! before any byte of it is returned ([`OpenFile::read`]).
//!
//! Invariants:
//! - no byte reaches a reader unless its chunk matched a hash list whose manifest id is
//!   the layout's for that stripe, so a stale, damaged or foreign copy is never served;
//! - a replica that cannot be opened, reached or verified is passed over for the next
//!   one with no error to the reader; EIO comes only when no replica can serve;
//! - every request to a storage node runs under the progress deadline
//!   ([`ferry_cluster::health::PROGRESS_DEADLINE`], or `-o timeout` if
//!   shorter): each moves at most [`FETCH_BYTES`], so a node that answers none in
//!   that time made no progress; its connection is dropped (the next read reconnects)
//!   and it is suspect;
//! - an open file reads the layout it was opened with, whatever the namespace says
//!   later.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use ferry_client::Credentials;
use ferry_cluster::health::Health;
use ferry_cluster::model::{stripe_count, Entry, Layout, NodeInfo, STORE_SHARE};
use ferry_cluster::{split_addr, Meta, NodeSet};
use ferry_common::msg::Hash256;
use ferry_common::transport::TransportChoice;
use fuser::Errno;

use crate::bufs::BufPool;
use crate::reader::{OpenFile, Reader};
use crate::remote::{lock, OpError, Remote, FETCH_BYTES};

/// How long the list of live nodes is trusted before etcd is asked again.
pub const NODES_TTL: Duration = Duration::from_secs(2);

/// The part of one stripe a read wants.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Piece {
    /// The stripe.
    pub index: usize,
    /// Offset in the stripe.
    pub offset: u64,
    /// Bytes wanted.
    pub len: u32,
}

/// The stripes, in order, covering `len` bytes at `offset` of a file of `size` bytes in
/// stripes of `stripe_bytes` (nothing past the end of the file).
pub fn pieces(size: u64, stripe_bytes: u64, offset: u64, len: u32) -> Vec<Piece> {
    let stripe_bytes = stripe_bytes.max(1);
    let end = offset.saturating_add(u64::from(len)).min(size);
    let mut out = Vec::new();
    let mut at = offset;
    while at < end {
        let index = at / stripe_bytes;
        let stripe_end = (index + 1).saturating_mul(stripe_bytes).min(end);
        out.push(Piece {
            index: usize::try_from(index).unwrap_or(usize::MAX),
            offset: at - index * stripe_bytes,
            len: (stripe_end - at) as u32,
        });
        at = stripe_end;
    }
    out
}

/// One storage node's connection and reader.
#[derive(Clone)]
pub struct Link {
    addr: String,
    remote: Arc<Remote>,
    reader: Arc<Reader>,
}

impl Link {
    /// The reader (its reply buffers take back what its reads returned).
    pub fn reader(&self) -> &Arc<Reader> {
        &self.reader
    }
}

/// The storage nodes of one cluster mount: the process's node set (shared with the
/// mount's writer), and a link to each node read from.
pub struct Nodes {
    set: Arc<NodeSet>,
    choice: TransportChoice,
    credentials: Credentials,
    timeout: Duration,
    cache_bytes: u64,
    readahead: Option<u32>,
    /// The link to each node read from, by id.
    links: Mutex<HashMap<String, Link>>,
}

impl Nodes {
    /// The nodes of `set`, connected to over `choice` with `credentials` (the store
    /// share's secret) as they are first read from. Each node's reader gets
    /// `cache_bytes` split evenly over the nodes live when it is made (at least two
    /// fetch buffers' worth), and `readahead` chunks of readahead. Nodes that fail or
    /// stall are suspect in `set` (shared with the mount's writer).
    pub fn new(
        set: Arc<NodeSet>,
        choice: TransportChoice,
        credentials: Credentials,
        timeout: Duration,
        cache_bytes: u64,
        readahead: Option<u32>,
    ) -> Arc<Nodes> {
        Arc::new(Nodes {
            set,
            choice,
            credentials,
            timeout,
            cache_bytes,
            readahead,
            links: Mutex::new(HashMap::new()),
        })
    }

    /// The node set.
    pub fn set(&self) -> &Arc<NodeSet> {
        &self.set
    }

    /// The etcd connection.
    pub fn meta(&self) -> &Meta {
        self.set.meta()
    }

    /// The live nodes, read from etcd now (within the mount's timeout).
    pub async fn refresh(&self) -> Result<Vec<NodeInfo>, OpError> {
        self.set
            .refresh_within(Some(self.timeout))
            .await
            .map_err(|e| OpError::new(Errno::EIO, format!("storage nodes: {e}")))
    }

    /// Reads the live nodes again if the last view is older than [`NODES_TTL`]; if etcd
    /// cannot answer, the last view stays.
    async fn fresh(&self) {
        self.set.fresh(NODES_TTL, self.timeout).await;
    }

    /// The order to read `replicas` in now ([`Health::read_order`]).
    pub async fn order(&self, replicas: &[String]) -> Vec<String> {
        self.fresh().await;
        self.set.read_order(replicas)
    }

    /// The node-health policy and the nodes suspect lately.
    pub fn health(&self) -> &Arc<Health> {
        self.set.health()
    }

    /// Node `id` failed or stalled (`why`): it is suspect ([`Health::suspect`]).
    pub fn suspect(&self, id: &str, why: &str) {
        self.set.suspect(id, why);
    }

    /// The bound on each request to a storage node: the progress deadline, or the
    /// mount's `-o timeout` if that is shorter.
    fn op_timeout(&self) -> Duration {
        self.timeout.min(self.health().policy().progress_deadline)
    }

    /// The link to live node `id`, made on first use (again if its address changed).
    pub fn link(&self, id: &str) -> Result<Link, OpError> {
        let addr = self
            .set
            .addr_of(id)
            .ok_or_else(|| OpError::new(Errno::ENOTCONN, format!("node {id} is not alive")))?;
        let live = self.set.live().len();
        let mut links = lock(&self.links);
        if let Some(link) = links.get(id).filter(|l| l.addr == addr) {
            return Ok(link.clone());
        }
        let (host, port) = split_addr(&addr)
            .ok_or_else(|| OpError::new(Errno::EIO, format!("node {id}: bad address {addr}")))?;
        let remote = Arc::new(Remote::new(
            host,
            port,
            self.choice,
            self.credentials.clone(),
            self.op_timeout(),
            0,
        ));
        let cache = (self.cache_bytes / live.max(1) as u64).max(2 * FETCH_BYTES as u64);
        let reader = Reader::new(remote.clone(), cache, self.readahead);
        let link = Link {
            addr,
            remote,
            reader,
        };
        links.insert(id.to_owned(), link.clone());
        Ok(link)
    }

    /// Connects to the first live node that answers and proves the store share's
    /// secret there: `Ok(Some(node, how))` with the transport, `Ok(None)` if no node
    /// answers, `Err` if a node refused the secret.
    pub async fn probe(&self) -> Result<Option<(String, String)>, ferry_client::ClientError> {
        let ids: Vec<String> = self.set.live().into_iter().map(|n| n.id).collect();
        for id in ids {
            let Ok(link) = self.link(&id) else { continue };
            let conn = match link.remote.conn().await {
                Ok(c) => c,
                Err(e) => {
                    tracing::warn!("node {id} ({}): {}", link.addr, e.message);
                    self.suspect(&id, &e.message);
                    continue;
                }
            };
            let bound = self.op_timeout();
            match tokio::time::timeout(bound, conn.client.authenticate(STORE_SHARE)).await {
                Ok(Ok(())) => {}
                Ok(Err(e)) if e.remote_kind().is_some() => return Err(e),
                Ok(Err(e)) => {
                    tracing::warn!("node {id} ({}): {e}", link.addr);
                    link.remote.drop_conn(&conn, &e.to_string());
                    self.suspect(&id, &e.to_string());
                    continue;
                }
                Err(_) => {
                    link.remote.drop_conn(&conn, "no answer within the timeout");
                    self.suspect(&id, &format!("no answer within {bound:?}"));
                    continue;
                }
            }
            let t = conn.client.transport();
            let how = match t.device() {
                Some(d) => format!("{} ({d})", t.kind().as_str()),
                None => t.kind().as_str().to_owned(),
            };
            return Ok(Some((id, how)));
        }
        Ok(None)
    }

    /// Space on the live nodes as last read: (capacity, free) in bytes, summed.
    pub async fn space(&self) -> (u64, u64) {
        self.fresh().await;
        self.set.live().iter().fold((0, 0), |(c, f), n| {
            (c.saturating_add(n.capacity), f.saturating_add(n.free))
        })
    }
}

/// A stripe opened on one node.
struct Opened {
    node: String,
    link: Link,
    file: OpenFile,
}

/// One open file of a cluster share: its entry as opened, and its stripes as they are
/// opened on their nodes.
pub struct ClusterFile {
    /// `share/path`, for logs.
    label: String,
    share: String,
    entry: Arc<Entry>,
    layout: Layout,
    manifests: Vec<Hash256>,
    stripes: Vec<tokio::sync::Mutex<Option<Arc<Opened>>>>,
}

/// Bytes read, and the reader whose buffer pool they came from (`None`: the caller's).
pub struct ReadOut {
    /// The bytes.
    pub data: Vec<u8>,
    /// Where to hand `data` back after the reply.
    pub home: Option<Arc<Reader>>,
}

impl ClusterFile {
    /// An open file of `entry` (a file) at `path` of `share`; EIO if its layout does
    /// not describe its size.
    pub fn new(share: &str, path: &str, entry: Arc<Entry>) -> Result<ClusterFile, OpError> {
        let label = format!("{share}/{path}");
        let bad = |why: String| OpError::new(Errno::EIO, format!("{label}: {why}"));
        let layout = match &entry.layout {
            Some(l) => l.clone(),
            None if entry.size == 0 => Layout {
                id: String::new(),
                algorithm: ferry_common::msg::HashAlgorithm::SUPPORTED[0],
                stripe_bytes: ferry_cluster::model::DEFAULT_STRIPE_BYTES,
                stripes: Vec::new(),
            },
            None => return Err(bad("a file with bytes and no layout".into())),
        };
        if layout.stripe_bytes == 0
            || layout.stripes.len() != stripe_count(entry.size, layout.stripe_bytes)
        {
            return Err(bad(format!(
                "the layout has {} stripes of {} bytes for {} bytes",
                layout.stripes.len(),
                layout.stripe_bytes,
                entry.size
            )));
        }
        let manifests = (0..layout.stripes.len())
            .map(|i| {
                layout
                    .manifest(i)
                    .ok_or_else(|| bad(format!("stripe {i}: bad manifest in the layout")))
            })
            .collect::<Result<Vec<_>, _>>()?;
        let stripes = (0..layout.stripes.len())
            .map(|_| tokio::sync::Mutex::new(None))
            .collect();
        Ok(ClusterFile {
            label,
            share: share.to_owned(),
            entry,
            layout,
            manifests,
            stripes,
        })
    }

    /// The entry this file was opened as.
    pub fn entry(&self) -> &Arc<Entry> {
        &self.entry
    }

    /// The layout id this file reads.
    pub fn layout_id(&self) -> &str {
        &self.layout.id
    }

    /// Reads `len` bytes at `offset` (fewer at the end of the file), from whichever
    /// replica of each stripe serves verified bytes. Output buffers come from `bufs`
    /// when the read spans stripes.
    pub async fn read(
        &self,
        nodes: &Nodes,
        bufs: &BufPool,
        offset: u64,
        len: u32,
    ) -> Result<ReadOut, OpError> {
        let wanted = pieces(self.entry.size, self.layout.stripe_bytes, offset, len);
        if let [one] = wanted.as_slice() {
            let (data, link) = self.read_stripe(nodes, *one).await?;
            return Ok(ReadOut {
                data,
                home: Some(link.reader.clone()),
            });
        }
        let total: u64 = wanted.iter().map(|p| u64::from(p.len)).sum();
        let mut out = bufs.take(total as usize);
        for piece in wanted {
            let (data, link) = self.read_stripe(nodes, piece).await?;
            out.extend_from_slice(&data);
            link.reader.recycle(data);
        }
        Ok(ReadOut {
            data: out,
            home: None,
        })
    }

    /// The read answered at once from verified chunks already cached, with no I/O, if
    /// every stripe it touches is open and has them; `None` otherwise. Needs a tokio
    /// runtime context (readahead is spawned).
    pub fn read_cached(&self, bufs: &BufPool, offset: u64, len: u32) -> Option<ReadOut> {
        let wanted = pieces(self.entry.size, self.layout.stripe_bytes, offset, len);
        let mut parts = Vec::with_capacity(wanted.len());
        for piece in &wanted {
            let opened = self.stripes.get(piece.index)?.try_lock().ok()?.clone()?;
            let data = opened
                .file
                .read_cached(&opened.link.reader, piece.offset, piece.len)?;
            parts.push((data, opened));
        }
        match parts.len() {
            0 => Some(ReadOut {
                data: Vec::new(),
                home: None,
            }),
            1 => {
                let (data, opened) = parts.pop()?;
                Some(ReadOut {
                    data,
                    home: Some(opened.link.reader.clone()),
                })
            }
            _ => {
                let mut out = bufs.take(parts.iter().map(|(d, _)| d.len()).sum());
                for (data, opened) in parts {
                    out.extend_from_slice(&data);
                    opened.link.reader.recycle(data);
                }
                Some(ReadOut {
                    data: out,
                    home: None,
                })
            }
        }
    }

    /// One stripe's part, from the first replica that serves it verified.
    async fn read_stripe(&self, nodes: &Nodes, piece: Piece) -> Result<(Vec<u8>, Link), OpError> {
        let index = piece.index;
        let mut passed: Vec<String> = Vec::new();
        let mut last: Option<String> = None;
        while let Some(opened) = self.opened(nodes, index, &mut passed, &mut last).await {
            let why = match opened
                .file
                .read(&opened.link.reader, piece.offset, piece.len)
                .await
            {
                Ok(data) if data.len() == piece.len as usize => {
                    return Ok((data, opened.link.clone()))
                }
                Ok(data) => {
                    let n = data.len();
                    opened.link.reader.recycle(data);
                    format!("{n} bytes where {} were due", piece.len)
                }
                Err(e) => e.message,
            };
            tracing::warn!(
                "{}: stripe {index} on node {}: {why}; reading another replica",
                self.label,
                opened.node
            );
            nodes.suspect(&opened.node, &why);
            passed.push(opened.node.clone());
            last = Some(format!("node {}: {why}", opened.node));
            let mut slot = self.stripes[index].lock().await;
            if slot.as_ref().is_some_and(|o| Arc::ptr_eq(o, &opened)) {
                *slot = None;
                opened.file.release();
            }
        }
        let replicas = self.layout.stripes[index].replicas.join(", ");
        Err(OpError::new(
            Errno::EIO,
            match last {
                Some(why) => format!(
                    "{}: stripe {index}: no replica could be read (last: {why})",
                    self.label
                ),
                None => format!(
                    "{}: stripe {index}: every node holding it ({replicas}) is down",
                    self.label
                ),
            },
        ))
    }

    /// Stripe `index` opened on a replica not in `passed`: the one it is open on, or
    /// the first in read order that opens and matches the layout (those that do not
    /// are added to `passed`, with why in `last`). `None` when none is left.
    async fn opened(
        &self,
        nodes: &Nodes,
        index: usize,
        passed: &mut Vec<String>,
        last: &mut Option<String>,
    ) -> Option<Arc<Opened>> {
        let mut slot = self.stripes[index].lock().await;
        if let Some(o) = slot.as_ref().filter(|o| !passed.contains(&o.node)) {
            return Some(o.clone());
        }
        for node in nodes.order(&self.layout.stripes[index].replicas).await {
            if passed.contains(&node) {
                continue;
            }
            match self.open_on(nodes, index, &node).await {
                Ok(o) => {
                    let o = Arc::new(o);
                    if let Some(old) = slot.replace(o.clone()) {
                        old.file.release();
                    }
                    return Some(o);
                }
                Err((e, node_down)) => {
                    tracing::warn!(
                        "{}: stripe {index}: node {node}: {}; trying another replica",
                        self.label,
                        e.message
                    );
                    if node_down {
                        nodes.suspect(&node, &e.message);
                    }
                    *last = Some(format!("node {node}: {}", e.message));
                    passed.push(node);
                }
            }
        }
        None
    }

    /// Opens stripe `index` on `node` and checks it is the layout's: `Err` with whether
    /// the node itself failed (rather than holding no such copy or another one).
    async fn open_on(
        &self,
        nodes: &Nodes,
        index: usize,
        node: &str,
    ) -> Result<Opened, (OpError, bool)> {
        let link = nodes.link(node).map_err(|e| (e, true))?;
        let conn = link.remote.conn().await.map_err(|e| (e, true))?;
        let chunk_bytes = conn.client.welcome().chunk_bytes;
        let object = self.layout.object_path(&self.share, index);
        let file = link
            .reader
            .open(STORE_SHARE, &object, chunk_bytes)
            .await
            .map_err(|e| {
                let down = !matches!(e.errno, Errno::ENOENT | Errno::EACCES);
                (e, down)
            })?;
        let v = file.version();
        let range = self.layout.stripe_range(self.entry.size, index);
        if v.manifest != self.manifests[index]
            || v.algorithm != self.layout.algorithm
            || v.size != range.end - range.start
        {
            file.release();
            return Err((
                OpError::new(
                    Errno::EIO,
                    format!("its copy of {object} does not match the layout's manifest"),
                ),
                false,
            ));
        }
        Ok(Opened {
            node: node.to_owned(),
            link,
            file,
        })
    }

    /// Releases every stripe's mapping (best effort, in the background). Needs a tokio
    /// runtime context.
    pub fn release(&self) {
        for slot in &self.stripes {
            if let Ok(mut s) = slot.try_lock() {
                if let Some(o) = s.take() {
                    o.file.release();
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    #[test]
    fn pieces_split_at_stripe_boundaries_and_stop_at_the_end() {
        let size = 7 * MIB + 123;
        assert_eq!(
            pieces(size, MIB, 10, 4096),
            vec![Piece {
                index: 0,
                offset: 10,
                len: 4096
            }]
        );
        assert_eq!(
            pieces(size, MIB, 2 * MIB - 100, 300),
            vec![
                Piece {
                    index: 1,
                    offset: MIB - 100,
                    len: 100
                },
                Piece {
                    index: 2,
                    offset: 0,
                    len: 200
                }
            ]
        );
        let tail = pieces(size, MIB, 7 * MIB + 100, 4096);
        assert_eq!(
            tail,
            vec![Piece {
                index: 7,
                offset: 100,
                len: 23
            }]
        );
        assert!(pieces(size, MIB, size, 10).is_empty());
        assert!(pieces(size, MIB, size + 5, 10).is_empty());
        assert!(pieces(0, MIB, 0, 10).is_empty());
        // Exactly one whole stripe, and three.
        assert_eq!(pieces(size, MIB, MIB, MIB as u32).len(), 1);
        let three = pieces(size, MIB, MIB - 1, (MIB + 2) as u32);
        assert_eq!(three.len(), 3);
        assert_eq!(three.iter().map(|p| u64::from(p.len)).sum::<u64>(), MIB + 2);
    }
}
