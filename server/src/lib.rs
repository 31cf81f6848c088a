//! ferryd, the Ferry file server, as a library.
//!
//! [`Server`] exports named shares (`share::Share`) and serves each connection with a
//! thin driver (`conn`) around the sans-IO [`ferry_common::proto::server`] session:
//! metadata requests run as plain filesystem calls (`fsops`; hard links are made
//! relative to directory descriptors, each parent opened once per request: `links`;
//! numeric owners and symlink mtimes, as root, without following links: `meta`;
//! tree removal and disk usage walk directory descriptors: `remove`, `du`,
//! `fdtree`); uploads are PULLED
//! with one-sided READs of the client's registered source window and downloads are
//! PUSHED with one-sided WRITEs into the client's registered buffers (`transfer`),
//! every chunk hashed with SHA-256, through a bounded per-connection pool of
//! registered chunk buffers (`pool`). Small files travel many per request, each batch
//! with one one-sided operation and one flush (`batch`). Mapped files (`map`) register a whole file
//! read-only, with its chunk manifest (`manifests`, cached server-wide), so a client
//! reads any part of it with one-sided READs and no request per read. Writable shares
//! keep manifests across restarts in a persistent store (`store`), which `Verify`
//! (`verify`) compares a file's bytes with. A writable mount writes files through
//! handles (`files`: staged or in place, every extent pulled with a one-sided READ and
//! verified before it is written) and moves and changes entries in place; every
//! connection's transport is wrapped to count what it moves (`traffic`).
//!
//! Uploads of several chunks are resumable: an interrupted one leaves a partial file and
//! its journal ([`ferry_common::staging`]), which the next upload of the same name
//! continues; `cleanup` removes what a killed ferryd left, once, at start.
//!
//! Each layer below the driver fails with its own error enum (naming the failed
//! operation, with the OS or transport error as its source), and so do the driver's
//! own refusals (`conn::ConnError`); `error` turns each into the wire's
//! [`RemoteError`] in one place, and only the driver's request-family modules
//! (`conn::*`) call those conversions, when they answer a request.
//!
//! Server-wide state lives in [`Server`]: the shares, the manifest cache, the budget of
//! mapped bytes and the counters [`Server::stats`] reports (live things are counted by
//! `gauge`s, so a leak shows as a count that does not fall back).
//!
//! Connection admission: a connection is counted from the moment it is accepted (TCP)
//! or its connect request arrives (RDMA) until everything it held is released, and at
//! most `max_connections` are counted at once over both transports. One over the limit
//! is still given its transport, told `Refused` (`Busy`, "server at its connection
//! limit (N)") and closed; at most [`MAX_REFUSING`] such refusals run at once, and
//! [`admission::MAX_REFUSING_PER_SOURCE`] to one address, beyond which a connection is
//! closed at accept with only a log line. Until its session
//! authenticates, a connection is also a startup of [`admission`]: its address may hold
//! only so many, startups over all addresses are refused at random and then all as
//! they near their own limit (below `max_connections`, so a flood of unauthenticated
//! connections cannot take every slot), and an address with too many failed
//! authentications lately is refused for a while; each such refusal is sent as the
//! limit's is. A startup must authenticate within its startup timeout
//! (`AdmissionConfig::startup_timeout`) of being accepted, or it is closed; its
//! transport set-up and session handshake count in that time.
#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod admission;
pub(crate) mod batch;
pub(crate) mod cleanup;
pub mod config;
pub(crate) mod conn;
pub(crate) mod dirs;
pub(crate) mod du;
pub(crate) mod error;
pub(crate) mod fdtree;
pub(crate) mod filekey;
pub(crate) mod files;
pub(crate) mod fsops;
pub(crate) mod gauge;
pub(crate) mod links;
pub(crate) mod manifests;
pub(crate) mod map;
pub(crate) mod meta;
pub(crate) mod nodes;
pub mod owners;
pub(crate) mod pool;
pub(crate) mod remove;
pub(crate) mod share;
pub(crate) mod store;
pub(crate) mod traffic;
pub(crate) mod transfer;
pub(crate) mod verify;
pub(crate) mod written;
pub(crate) mod xattrs;

use std::collections::HashMap;
use std::future::Future;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use ferry_common::auth::{Secret, ShareAccess};
use ferry_common::codec::MAX_SERVER_REQUEST_FRAME_BYTES;
use ferry_common::msg::{ErrorKind, RemoteError, ServerStats};
use ferry_common::proto::server::AccessTable;
use ferry_common::seal::Encryption;
use ferry_common::transport::tcp::Tcp;
use ferry_common::transport::{SharedTransport, TransportError};
use tokio::net::TcpListener;
use tokio::sync::{watch, Semaphore};

use admission::{Admission, Gate};
pub use config::{ClusterNode, Config, ConfigError, ShareConfig};
use gauge::Gauge;
use manifests::{ManifestCache, MANIFEST_CACHE_BYTES};
use map::MapBudget;
use share::Share;

/// Software name sent in the welcome.
pub const SOFTWARE: &str = concat!("ferryd/", env!("CARGO_PKG_VERSION"));

/// Most connections over the limit being told so at once; each holds a socket and a
/// task for at most [`REFUSE_TIMEOUT`]. Beyond this, one is closed at accept.
pub const MAX_REFUSING: usize = 32;

/// How long a connection over the limit may take to set up its transport, be told
/// `Refused` and close.
pub const REFUSE_TIMEOUT: Duration = Duration::from_secs(3);

/// A running server's shared state.
pub struct Server {
    shares: HashMap<String, Arc<Share>>,
    /// How each share is guarded; every session checks its requests against it.
    access: Arc<AccessTable>,
    /// Each share's encryption policy.
    policies: Arc<HashMap<String, Encryption>>,
    /// When encrypted sessions update the keys ferryd sends under.
    rekey: ferry_common::seal::RekeyPolicy,
    queue_depth: usize,
    chunk_bytes: u32,
    stop: watch::Sender<bool>,
    /// Connections admitted and not yet released (see the module docs).
    live: Gauge,
    /// Most connections counted in `live` at once.
    max_connections: u64,
    /// One permit per connection over the limit being refused.
    refusing: Arc<Semaphore>,
    /// Connections not yet authenticated, and failed authentications, by address.
    gate: Gate,
    /// How long after accept a connection must have authenticated.
    startup_timeout: Duration,
    /// Memory registered by the server (chunk buffers, mapped-file windows and
    /// manifests), over every connection.
    registrations: Gauge,
    /// Uploads and downloads open, over every connection.
    transfers: Gauge,
    /// Requests dispatched since start, over every connection.
    requests: AtomicU64,
    /// Bytes moved (one-sided, in control frames, written by file handles) since
    /// start, over every connection.
    traffic: Arc<traffic::Traffic>,
    /// Chunk manifests of mapped files, shared by every connection.
    manifests: Arc<ManifestCache>,
    /// Registered mapped-file bytes and open mapped files, over every connection.
    map_budget: Arc<MapBudget>,
    /// When this server was created: hidden files changed since are its own.
    started: SystemTime,
    /// Age beyond which [`Server::clean_stale_files`] removes a resumable partial.
    partial_ttl: Duration,
    /// The cluster this server is a node of.
    cluster: Option<config::ClusterNode>,
    /// Its etcd, connected at the first `Replicate` and shared by every later one
    /// (etcd's client reconnects by itself; one connection per process).
    #[cfg(feature = "cluster")]
    cluster_etcd: Option<Arc<ferry_cluster::EtcdLink>>,
    /// Every session's file locks (the `locks` capability).
    locks: std::sync::Mutex<ferry_common::locks::LockTable>,
    /// The id the next connection's locks are held under.
    next_lock_session: AtomicU64,
}

impl Server {
    /// Opens every share of `config` (their roots must exist and be directories) and
    /// loads their secrets (a share without one is an error unless
    /// `config.insecure_no_auth`).
    pub fn new(config: &Config) -> Result<Arc<Server>, ConfigError> {
        let mut shares = HashMap::new();
        let mut access = AccessTable::new();
        let mut policies = HashMap::new();
        for s in &config.shares {
            policies.insert(s.name.clone(), s.encryption.unwrap_or(config.encryption));
            let share = Share::open(s)?;
            if shares.insert(s.name.clone(), Arc::new(share)).is_some() {
                return Err(ConfigError::DuplicateShare(s.name.clone()));
            }
            access.insert(s.name.clone(), share_access(s, config.insecure_no_auth)?);
        }
        if shares.is_empty() {
            return Err(ConfigError::NoShares);
        }
        Ok(Arc::new(Server {
            shares,
            access: Arc::new(access),
            policies: Arc::new(policies),
            rekey: config.rekey,
            queue_depth: config.queue_depth,
            chunk_bytes: ferry_common::msg::DEFAULT_CHUNK_BYTES,
            stop: watch::channel(false).0,
            live: Gauge::new(),
            max_connections: config.max_connections as u64,
            refusing: Arc::new(Semaphore::new(MAX_REFUSING)),
            gate: Gate::new(Admission::new(
                config.admission,
                config.max_connections as u64,
            )),
            startup_timeout: config.admission.startup_timeout,
            registrations: Gauge::new(),
            transfers: Gauge::new(),
            requests: AtomicU64::new(0),
            traffic: Arc::default(),
            manifests: Arc::new(ManifestCache::new(MANIFEST_CACHE_BYTES)),
            map_budget: MapBudget::new(config.max_mapped_bytes),
            started: SystemTime::now(),
            partial_ttl: config.partial_ttl,
            cluster: config.cluster.clone(),
            #[cfg(feature = "cluster")]
            cluster_etcd: config
                .cluster
                .as_ref()
                .map(|node| ferry_cluster::EtcdLink::new(node.etcd.clone())),
            locks: std::sync::Mutex::new(ferry_common::locks::LockTable::new()),
            next_lock_session: AtomicU64::new(1),
        }))
    }

    /// The file locks of every session. Held only for a table operation (no I/O).
    pub(crate) fn locks(&self) -> std::sync::MutexGuard<'_, ferry_common::locks::LockTable> {
        // Table operations do not panic; a poisoned table is still consistent.
        self.locks.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A fresh id for a connection's locks; never reused.
    pub(crate) fn lock_session(&self) -> u64 {
        self.next_lock_session.fetch_add(1, Ordering::Relaxed)
    }

    /// The cluster this server is a storage node of, if any.
    pub fn cluster(&self) -> Option<&config::ClusterNode> {
        self.cluster.as_ref()
    }

    /// The process's one etcd connection when this server is a cluster node (its
    /// [`Server::cluster`]): shared by the node's registration and `Replicate`.
    #[cfg(feature = "cluster")]
    pub fn cluster_etcd(&self) -> Option<&Arc<ferry_cluster::EtcdLink>> {
        self.cluster_etcd.as_ref()
    }

    /// The encryption policy of share `name` (its own, else the configuration's
    /// default); also what this node asks of the nodes it fetches that share from.
    pub fn policy(&self, name: &str) -> Encryption {
        self.policies
            .get(name)
            .copied()
            .unwrap_or(config::DEFAULT_ENCRYPTION)
    }

    /// When encrypted sessions update the keys ferryd sends under (with clients that
    /// support key updates).
    pub fn rekey(&self) -> ferry_common::seal::RekeyPolicy {
        self.rekey
    }

    /// The secret guarding share `name`, if it has one.
    pub fn secret(&self, name: &str) -> Option<&ferry_common::auth::Secret> {
        match self.access.get(name) {
            Some(ShareAccess::Secret(s)) => Some(s),
            _ => None,
        }
    }

    /// Whether share `name` is served without a secret.
    pub fn is_open(&self, name: &str) -> bool {
        matches!(self.access.get(name), Some(ShareAccess::Open))
    }

    /// Removes the hidden files a killed ferryd left in the writable shares (see
    /// `cleanup`) and the manifest records of files that are gone
    /// (`store::ManifestStore::prune`), logging one line per share for each.
    /// Read-only shares are not touched.
    /// Blocking; meant for a background thread at start, while connections are served.
    pub fn clean_stale_files(&self) {
        let mut shares: Vec<&Arc<Share>> = self.shares.values().collect();
        shares.sort_by(|a, b| a.name().cmp(b.name()));
        for share in shares {
            if share.read_only() {
                continue;
            }
            let mut r = cleanup::clean_tree(share.root(), self.partial_ttl, self.started);
            // The state directory is not walked above; its incoming files are transfer
            // files like any other (partial fetches of `Replicate`).
            let incoming = share.incoming_path();
            if incoming.is_dir() {
                let i = cleanup::clean_tree(&incoming, self.partial_ttl, self.started);
                r.removed += i.removed;
                r.kept += i.kept;
                r.live += i.live;
                r.failed += i.failed;
            }
            tracing::info!(
                "share {}: startup cleanup removed {} stale temporary files, kept {} resumable partial uploads ({} hidden files in use, {} failures)",
                share.name(),
                r.removed,
                r.kept,
                r.live,
                r.failed
            );
            {
                let p = share.store().prune(self.started);
                tracing::info!(
                    "share {}: manifest store kept {} records, removed {} of files that are gone ({} failures)",
                    share.name(),
                    p.kept,
                    p.removed,
                    p.failed
                );
            }
        }
    }

    /// Counts one dispatched request.
    fn count_request(&self) {
        self.requests.fetch_add(1, Ordering::Relaxed);
    }

    /// The server's counters now.
    pub fn stats(&self) -> ServerStats {
        ServerStats {
            requests: self.requests.load(Ordering::Relaxed),
            connections: self.connections() as u64,
            mapped_files: self.map_budget.files(),
            mapped_bytes: self.map_budget.bytes(),
            registrations: self.registrations.get(),
            open_transfers: self.transfers.get(),
        }
    }

    /// Admits a connection that arrived at `accepted` from `peer`, on a task of its
    /// own: if [`Server::admission`] lets it in, `setup` brings its transport up (within
    /// the startup timeout of `accepted`) and it is served; else it is refused (see
    /// [`Server::spawn_refusal`]).
    fn admit<F>(self: &Arc<Self>, peer: String, accepted: Instant, setup: F)
    where
        F: Future<Output = Result<SharedTransport, TransportError>> + Send + 'static,
    {
        let admitted = match self.admission(&peer, accepted) {
            Ok(a) => a,
            Err(refused) => {
                self.spawn_refusal(peer, setup, refused);
                return;
            }
        };
        let server = self.clone();
        tokio::spawn(async move {
            let timeout = server.startup_timeout;
            let deadline = accepted + timeout;
            let mut stop = server.stop_signal();
            let set_up = tokio::select! {
                set_up = tokio::time::timeout_at(deadline.into(), setup) => set_up,
                _ = stop.wait_for(|stopping| *stopping) => {
                    tracing::debug!(%peer, "connection dropped at shutdown, before its transport was up");
                    return;
                }
            };
            match set_up {
                Ok(Ok(t)) => conn::run(server, t, admitted).await,
                Ok(Err(e)) => tracing::warn!(%peer, "connection failed at transport set-up: {e}"),
                Err(_) => tracing::warn!(
                    %peer,
                    "connection dropped: transport not set up within {timeout:?}"
                ),
            }
        });
    }

    /// Counts a connection from `peer` accepted at `accepted`, in the connection limit
    /// and as a startup of its address, or says why it is refused: the limit first
    /// (its refusal is the documented one), then the address's failed
    /// authentications, its startups and everyone's (see [`admission`]).
    fn admission(&self, peer: &str, accepted: Instant) -> Result<conn::Admitted, Refused> {
        let Some(live) = self.live.try_hold(1, self.max_connections) else {
            return Err(Refused {
                error: self.at_limit(),
                log: true,
            });
        };
        let source = source_address(peer);
        // Uniform in 0..100; the bias of the modulo is below one in 40 million.
        let roll = || rand::random::<u32>() % 100;
        match self.gate.connect(accepted, source, roll) {
            Ok(startup) => Ok(conn::Admitted {
                live,
                startup,
                source,
                accepted,
            }),
            Err(refusal) => Err(Refused {
                error: refusal.to_remote(),
                log: refusal.log(),
            }),
        }
    }

    /// Records a failed authentication from `source`, logging once when it makes the
    /// address be refused for a while.
    pub(crate) fn auth_failed(&self, source: IpAddr) {
        if let Some(refused_for) = self.gate.auth_failed(Instant::now(), source) {
            tracing::warn!(
                %source,
                "too many failed authentications (limit {}): refusing connections from {source} for {} s",
                self.gate.limits().auth_failures,
                refused_for.as_secs_f64().ceil()
            );
        }
    }

    /// How long after accept a connection must have authenticated.
    pub(crate) fn startup_timeout(&self) -> Duration {
        self.startup_timeout
    }

    /// Refuses a connection from `peer` on a task of its own: `setup`
    /// brings its transport up, the peer is told `Refused` with `refused.error` and the
    /// connection closed, all within [`REFUSE_TIMEOUT`]. If [`MAX_REFUSING`] refusals
    /// are already running, or [`admission::MAX_REFUSING_PER_SOURCE`] to its address,
    /// `setup` is dropped unused instead, which closes the connection at once.
    fn spawn_refusal<F>(self: &Arc<Self>, peer: String, setup: F, refused: Refused)
    where
        F: Future<Output = Result<SharedTransport, TransportError>> + Send + 'static,
    {
        let Refused { error, log } = refused;
        let slot = self
            .gate
            .refusing(source_address(&peer))
            .and_then(|s| Some((s, self.refusing.clone().try_acquire_owned().ok()?)));
        let Some(slot) = slot else {
            if log {
                tracing::warn!(%peer, "refused: {}; closed at accept", error.message);
            }
            return;
        };
        if log {
            tracing::warn!(%peer, "refused: {}", error.message);
        }
        tokio::spawn(async move {
            let refused = tokio::time::timeout(REFUSE_TIMEOUT, async {
                conn::refuse(setup.await?, error).await;
                Ok::<_, TransportError>(())
            })
            .await;
            match refused {
                Ok(Ok(())) => {}
                Ok(Err(e)) => tracing::debug!(%peer, "refused connection failed at set-up: {e}"),
                Err(_) => {
                    tracing::debug!(%peer, "refused connection still open after {REFUSE_TIMEOUT:?}; closed")
                }
            }
            drop(slot);
        });
    }

    /// The refusal sent to a connection over the limit.
    fn at_limit(&self) -> RemoteError {
        RemoteError {
            kind: ErrorKind::Busy,
            message: format!("server at its connection limit ({})", self.max_connections),
        }
    }

    fn stop_signal(&self) -> watch::Receiver<bool> {
        self.stop.subscribe()
    }

    /// Number of connections being served.
    pub fn connections(&self) -> usize {
        self.live.get() as usize
    }

    /// Stops accepting, ends every connection (unfinished uploads keep their resumable
    /// partial files, scratch files are removed) and waits up to `grace` for them to
    /// finish. Returns the
    /// number of connections still open when the grace period ran out.
    pub async fn shutdown(&self, grace: Duration) -> usize {
        self.stop.send_replace(true);
        let deadline = tokio::time::Instant::now() + grace;
        while self.connections() > 0 && tokio::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        self.connections()
    }

    /// The share called `name`.
    pub(crate) fn share(&self, name: &str) -> Option<&Arc<Share>> {
        self.shares.get(name)
    }

    /// Accepts TCP connections until [`Server::shutdown`], serving each on its own task.
    pub async fn serve_tcp(self: Arc<Self>, listener: TcpListener) {
        let mut stop = self.stop_signal();
        loop {
            let accepted = tokio::select! {
                a = listener.accept() => a,
                _ = stop.wait_for(|stopping| *stopping) => return,
            };
            let (stream, peer) = match accepted {
                Ok(x) => x,
                Err(e) => {
                    // EMFILE and friends: log, back off briefly, keep serving.
                    tracing::warn!("accept failed: {e}");
                    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                    continue;
                }
            };
            self.admit(peer.to_string(), Instant::now(), async move {
                // A server receives only hellos and requests.
                let t =
                    Tcp::start_with_limit(stream, MAX_SERVER_REQUEST_FRAME_BYTES as u32).await?;
                let t: SharedTransport = Arc::new(t);
                Ok(t)
            });
        }
    }

    /// Accepts RDMA connections until [`Server::shutdown`], serving each on its own task
    /// exactly like a TCP connection.
    #[cfg(feature = "rdma")]
    pub async fn serve_rdma(self: Arc<Self>, listener: ferry_common::transport::rdma::Listener) {
        let mut stop = self.stop_signal();
        loop {
            let incoming = tokio::select! {
                a = listener.accept() => a,
                _ = stop.wait_for(|stopping| *stopping) => return,
            };
            let incoming = match incoming {
                Ok(i) => i,
                Err(e @ TransportError::Unavailable(_)) => {
                    tracing::error!("RDMA listener stopped: {e}");
                    return;
                }
                Err(e) => {
                    tracing::warn!("RDMA accept failed: {e}");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            };
            // Dropped unused (a refusal when too many are running), `incoming`
            // rejects the connect request.
            self.admit(incoming.peer(), Instant::now(), async move {
                let t: SharedTransport = Arc::new(incoming.establish().await?);
                Ok(t)
            });
        }
    }

    /// Serves one connection, whose transport is already up, until it closes.
    /// Everything the connection owned (open transfers, registrations) is released on
    /// return; see `conn` for what happens to the hidden files of unfinished
    /// uploads. Refused by [`Server::admission`] (over the connection limit, say), the
    /// peer is told `Refused` instead and the connection closed.
    pub async fn handle_connection(self: Arc<Self>, transport: SharedTransport) {
        match self.admission(&transport.peer(), Instant::now()) {
            Ok(admitted) => conn::run(self, transport, admitted).await,
            Err(Refused { error, log }) => {
                if log {
                    tracing::warn!(peer = %transport.peer(), "refused: {}", error.message);
                }
                let _ = tokio::time::timeout(REFUSE_TIMEOUT, conn::refuse(transport, error)).await;
            }
        }
    }
}

/// Why a connection is refused before it is served, and whether to log it.
struct Refused {
    error: RemoteError,
    log: bool,
}

/// The address a connection from `peer` (`ADDR:PORT`, as transports name peers) counts
/// against; one that does not parse counts as the unspecified address, all together.
fn source_address(peer: &str) -> IpAddr {
    peer.parse::<SocketAddr>()
        .map(|a| a.ip().to_canonical())
        .unwrap_or(IpAddr::V4(Ipv4Addr::UNSPECIFIED))
}

/// How share `s` is guarded: its secret, loaded now (so a bad secret file stops ferryd
/// at start), or open when it has none and `insecure` allows that.
fn share_access(s: &ShareConfig, insecure: bool) -> Result<ShareAccess, ConfigError> {
    let loaded = match (&s.secret_file, &s.secret_env) {
        (Some(file), _) => Secret::from_file(file),
        (None, Some(var)) => Secret::from_env(var),
        (None, None) if insecure => return Ok(ShareAccess::Open),
        (None, None) => return Err(ConfigError::NoSecret(s.name.clone())),
    };
    loaded
        .map(ShareAccess::Secret)
        .map_err(|source| ConfigError::Secret {
            share: s.name.clone(),
            source,
        })
}
