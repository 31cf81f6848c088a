//! ferryd, the Ferry file server, as a library.
//!
//! [`Server`] exports named shares ([`share::Share`]) and serves each connection with a
//! thin driver ([`conn`]) around the sans-IO [`ferry_common::proto::server`] session:
//! metadata requests run as plain filesystem calls ([`fsops`]); uploads are PULLED
//! with one-sided READs of the client's registered source window and downloads are
//! PUSHED with one-sided WRITEs into the client's registered buffers ([`transfer`]),
//! every chunk hashed with SHA-256, through a bounded per-connection pool of
//! registered chunk buffers ([`pool`]). Mapped files ([`map`]) register a whole file
//! read-only, with its chunk manifest ([`manifests`], cached server-wide), so a client
//! reads any part of it with one-sided READs and no request per read.
//!
//! Uploads of several chunks are resumable: an interrupted one leaves a partial file and
//! its journal ([`ferry_common::staging`]), which the next upload of the same name
//! continues; [`cleanup`] removes what a killed ferryd left, once, at start.
//!
//! Server-wide state lives in [`Server`]: the shares, the manifest cache, the budget of
//! mapped bytes and the counters [`Server::stats`] reports (live things are counted by
//! [`gauge`]s, so a leak shows as a count that does not fall back).
#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod cleanup;
pub mod config;
pub mod conn;
pub mod error;
pub mod fsops;
pub mod gauge;
pub mod manifests;
pub mod map;
pub mod pool;
pub mod share;
pub mod transfer;

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use ferry_common::auth::{Secret, ShareAccess};
use ferry_common::msg::ServerStats;
use ferry_common::proto::server::AccessTable;
use ferry_common::transport::tcp::Tcp;
use ferry_common::transport::SharedTransport;
use tokio::net::TcpListener;
use tokio::sync::watch;

pub use config::{Config, ConfigError, ShareConfig};
use gauge::{Gauge, Held};
use manifests::{ManifestCache, MANIFEST_CACHE_BYTES};
use map::MapBudget;
use share::Share;

/// Software name sent in the welcome.
pub const SOFTWARE: &str = concat!("ferryd/", env!("CARGO_PKG_VERSION"));

/// A running server's shared state.
pub struct Server {
    shares: HashMap<String, Arc<Share>>,
    /// How each share is guarded; every session checks its requests against it.
    access: Arc<AccessTable>,
    queue_depth: usize,
    chunk_bytes: u32,
    stop: watch::Sender<bool>,
    /// Connections being served.
    live: Gauge,
    /// Memory registered by the server (chunk buffers, mapped-file windows and
    /// manifests), over every connection.
    registrations: Gauge,
    /// Uploads and downloads open, over every connection.
    transfers: Gauge,
    /// Requests dispatched since start, over every connection.
    requests: AtomicU64,
    /// Chunk manifests of mapped files, shared by every connection.
    manifests: ManifestCache,
    /// Registered mapped-file bytes and open mapped files, over every connection.
    map_budget: Arc<MapBudget>,
    /// When this server was created: hidden files changed since are its own.
    started: SystemTime,
    /// Age beyond which [`Server::clean_stale_files`] removes a resumable partial.
    partial_ttl: Duration,
}

impl Server {
    /// Opens every share of `config` (their roots must exist and be directories) and
    /// loads their secrets (a share without one is an error unless
    /// `config.insecure_no_auth`).
    pub fn new(config: &Config) -> Result<Arc<Server>, ConfigError> {
        let mut shares = HashMap::new();
        let mut access = AccessTable::new();
        for s in &config.shares {
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
            queue_depth: config.queue_depth,
            chunk_bytes: ferry_common::msg::DEFAULT_CHUNK_BYTES,
            stop: watch::channel(false).0,
            live: Gauge::new(),
            registrations: Gauge::new(),
            transfers: Gauge::new(),
            requests: AtomicU64::new(0),
            manifests: ManifestCache::new(MANIFEST_CACHE_BYTES),
            map_budget: MapBudget::new(config.max_mapped_bytes),
            started: SystemTime::now(),
            partial_ttl: config.partial_ttl,
        }))
    }

    /// Whether share `name` is served without a secret.
    pub fn is_open(&self, name: &str) -> bool {
        matches!(self.access.get(name), Some(ShareAccess::Open))
    }

    /// Removes the hidden files a killed ferryd left in the writable shares (see
    /// [`cleanup`]), logging one line per share. Read-only shares are not touched.
    /// Blocking; meant for a background thread at start, while connections are served.
    pub fn clean_stale_files(&self) {
        let mut shares: Vec<&Arc<Share>> = self.shares.values().collect();
        shares.sort_by(|a, b| a.name().cmp(b.name()));
        for share in shares {
            if share.read_only() {
                continue;
            }
            let r = cleanup::clean_tree(share.root(), self.partial_ttl, self.started);
            tracing::info!(
                "share {}: startup cleanup removed {} stale temporary files, kept {} resumable partial uploads ({} hidden files in use, {} failures)",
                share.name(),
                r.removed,
                r.kept,
                r.live,
                r.failed
            );
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

    fn live_guard(&self) -> Held {
        self.live.hold(1)
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
    pub fn share(&self, name: &str) -> Option<&Arc<Share>> {
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
            let server = self.clone();
            tokio::spawn(async move {
                match Tcp::start(stream).await {
                    Ok(t) => server.handle_connection(Arc::new(t)).await,
                    Err(e) => tracing::warn!(%peer, "connection refused at transport setup: {e}"),
                }
            });
        }
    }

    /// Accepts RDMA connections until [`Server::shutdown`], serving each on its own task
    /// exactly like a TCP connection.
    #[cfg(feature = "rdma")]
    pub async fn serve_rdma(self: Arc<Self>, listener: ferry_common::transport::rdma::Listener) {
        use ferry_common::transport::TransportError;
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
            let server = self.clone();
            tokio::spawn(async move {
                let peer = incoming.peer();
                match incoming.establish().await {
                    Ok(t) => server.handle_connection(Arc::new(t)).await,
                    Err(e) => tracing::warn!(%peer, "RDMA connection refused at set-up: {e}"),
                }
            });
        }
    }

    /// Serves one connection until it closes. Everything the connection owned (open
    /// transfers, registrations) is released on return; see [`conn`] for what happens
    /// to the hidden files of unfinished uploads.
    pub async fn handle_connection(self: Arc<Self>, transport: SharedTransport) {
        conn::run(self, transport).await
    }
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
