//! A connection to ferryd: a thin driver around the sans-IO
//! [`ClientSession`], shared by every concurrent operation of one `rcp` run.
//!
//! A background task feeds received messages into the session and completes the
//! waiting calls; [`Client::call`] queues a request and waits for its response.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use ferry_common::auth::Secret;
use ferry_common::codec;
use ferry_common::msg::{
    Attr, AttrEntry, DirEntry, DiskUsage, ErrorKind, FileVersion, FsStat, Hash256, HashAlgorithm,
    MappedFile, MetaEntry, NewDir, Owner, RemoteError, Request, Response, ServerStats, Timestamp,
    VerifyReport, Welcome, BATCH_MAX_PATH_BYTES, LINK_BATCH_MAX, META_BATCH_MAX,
};
use ferry_common::proto::caps::{EncryptOffer, Negotiated, Offer};
use ferry_common::proto::client::{ClientEvent, ClientSession, Liveness};
use ferry_common::proto::manifest::{ManifestError, ManifestReader};
use ferry_common::proto::ProtoError;
use ferry_common::seal::{Encryption, KeyShare, RekeyPolicy, Suite};
use ferry_common::transport::sealed::Sealed;
use ferry_common::transport::tcp::Tcp;
use ferry_common::transport::{Buffer, SharedTransport, TransportChoice, TransportError};
use tokio::sync::{oneshot, Notify, OnceCell};

use crate::error::ClientError;

/// Software name sent in the hello.
pub const SOFTWARE: &str = concat!("ferry-client/", env!("CARGO_PKG_VERSION"));

/// How long to wait for a TCP connection to be accepted.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// How often the liveness watch looks at the session's timers beside the driver (which
/// may be held up sending to a server that stopped reading).
const LIVENESS_TICK: Duration = Duration::from_millis(250);

type Waiter = oneshot::Sender<Result<Response, ClientError>>;

/// Calls waiting for responses. Invariant: once `closed` is set (by the driver, as it
/// exits) the map is empty and stays empty, so no call can wait forever.
#[derive(Default)]
struct Waiters {
    map: HashMap<u64, Waiter>,
    closed: Option<String>,
}

/// A handshake's outcome: the welcome, or why it failed and the kind of the server's
/// refusal if it refused.
type Handshake = Result<Welcome, (String, Option<ErrorKind>)>;

struct Inner {
    transport: SharedTransport,
    /// The encryption layer (`transport` itself), armed when the welcome agrees.
    sealed: Arc<Sealed>,
    /// The client's key share until the welcome uses it.
    key_share: Mutex<Option<KeyShare>>,
    session: Mutex<ClientSession>,
    /// Wakes the driver after a request was queued, so that it re-reads the session's
    /// next deadline (the liveness clock starts with the first request).
    wake: Notify,
    waiters: Mutex<Waiters>,
    /// The handshake's outcome: the welcome, or why it failed and the kind of the
    /// server's refusal if it refused.
    connected: Mutex<Option<oneshot::Sender<Handshake>>>,
    welcome: Mutex<Option<Welcome>>,
    /// What the handshake agreed on, kept once it is done.
    negotiated: Mutex<Option<Negotiated>>,
    /// Reusable download buffers, so fresh memory is faulted in only once per run.
    buffers: Mutex<Vec<Arc<Buffer>>>,
    addr: String,
    credentials: Credentials,
    /// Per share: the outcome of this session's proof of its secret, made once, by the
    /// first request that names the share (concurrent ones wait for it).
    proofs: Mutex<HashMap<String, Arc<Proof>>>,
    /// Per share: the algorithm its new data is hashed in ([`Client::share_hash`]).
    share_hashes: Mutex<HashMap<String, HashAlgorithm>>,
    /// The algorithms files of this session moved in ([`Client::used_hash`]).
    hashes_used: Mutex<Vec<HashAlgorithm>>,
}

/// The outcome of a session's proof of one share's secret, decided once.
type Proof = OnceCell<Result<(), RemoteError>>;

/// The secrets a client proves to a server, by share.
#[derive(Clone, Debug, Default)]
pub struct Credentials {
    default: Option<Secret>,
    shares: HashMap<String, Secret>,
    /// The one chunk-hash algorithm to offer (`--hash`), instead of every one this
    /// build supports.
    hash_only: Option<HashAlgorithm>,
    /// Whether to offer (or require) encryption (`--encryption`).
    encryption: Encryption,
    /// Leave the directory batches out of the offer.
    no_dir_batches: bool,
    /// When the session gives up on a silent server.
    liveness: Liveness,
    /// When an encrypted session updates the keys this client sends under.
    rekey: RekeyPolicy,
}

impl Credentials {
    /// No secrets: only shares the server serves openly are usable.
    pub fn none() -> Credentials {
        Credentials::default()
    }

    /// `secret` for every share.
    pub fn with_default(secret: Secret) -> Credentials {
        Credentials {
            default: Some(secret),
            shares: HashMap::new(),
            hash_only: None,
            encryption: Encryption::default(),
            no_dir_batches: false,
            liveness: Liveness::default(),
            rekey: RekeyPolicy::default(),
        }
    }

    /// Ends a session whose server sends nothing, not even an answer to a liveness
    /// probe, for `silence_limit` while requests wait (default
    /// [`ferry_common::proto::SERVER_SILENCE_LIMIT`]); the requests fail with
    /// [`ClientError::Hung`].
    pub fn with_silence_limit(self, silence_limit: std::time::Duration) -> Credentials {
        self.with_liveness(Liveness::with_limit(silence_limit))
    }

    /// Sessions probe and give up on a silent server as `liveness` says.
    pub fn with_liveness(mut self, liveness: Liveness) -> Credentials {
        self.liveness = liveness;
        self
    }

    /// The liveness policy sessions get.
    pub fn liveness(&self) -> Liveness {
        self.liveness
    }

    /// Offers only `algorithm` for chunk hashes (`rcp --hash`, `ferry-mount --hash`):
    /// new data is then hashed in it, and a server that cannot use it refuses the
    /// session (or, for a share that records another, its uploads).
    pub fn with_hash(mut self, algorithm: Option<HashAlgorithm>) -> Credentials {
        self.hash_only = algorithm;
        self
    }

    /// Offers (`preferred`, the default), requires or leaves out encryption
    /// (`rcp --encryption`, `ferry-mount -o encryption=`).
    pub fn with_encryption(mut self, encryption: Encryption) -> Credentials {
        self.encryption = encryption;
        self
    }

    /// Moves to new keys for what this client sends after `bytes` under one key
    /// (`rcp --rekey-after`; unset: [`RekeyPolicy::default`]), with a server that
    /// supports key updates.
    pub fn with_rekey_after(mut self, bytes: Option<u64>) -> Credentials {
        self.rekey.after_bytes = bytes.unwrap_or(self.rekey.after_bytes);
        self
    }

    /// Leaves the directory batches (capability `dirs`) out of the offer, so the
    /// session speaks as a client before them does: an upload then makes and finishes
    /// its directories one `Mkdir` and one `SetAttr` each. That path is what every
    /// server without the batches gets; this checks it against a current one.
    pub fn without_dir_batches(mut self) -> Credentials {
        self.no_dir_batches = true;
        self
    }

    /// The encryption policy.
    pub fn encryption(&self) -> Encryption {
        self.encryption
    }

    /// What the client offers in its hello, with `key` as its key share when it
    /// offers encryption.
    fn offer(&self, key: Option<&KeyShare>) -> Offer {
        Offer {
            hashes: match self.hash_only {
                Some(a) => vec![a],
                None => HashAlgorithm::SUPPORTED.to_vec(),
            },
            encrypt: key.map(|k| EncryptOffer {
                suites: Suite::preferred().to_vec(),
                key: k.public(),
                required: self.encryption == Encryption::Required,
            }),
            dirs: !self.no_dir_batches,
            ..Offer::default()
        }
    }

    /// Uses `secret` for `share` (over the default).
    pub fn insert(&mut self, share: &str, secret: Secret) {
        self.shares.insert(share.to_string(), secret);
    }

    /// The secret to prove for `share`, if any.
    pub fn for_share(&self, share: &str) -> Option<&Secret> {
        self.shares.get(share).or(self.default.as_ref())
    }

    /// The secret a command-line client was given: the file `file` (from a flag or
    /// `$FERRY_SECRET_FILE`), else `$FERRY_SECRET`, else none.
    pub fn from_file_or_env(file: Option<&std::path::Path>) -> Result<Credentials, ClientError> {
        if let Some(f) = file {
            return Ok(Credentials::with_default(Secret::from_file(f)?));
        }
        if std::env::var_os(SECRET_ENV).is_some() {
            return Ok(Credentials::with_default(Secret::from_env(SECRET_ENV)?));
        }
        Ok(Credentials::none())
    }
}

/// Environment variable a command-line client reads its secret from when it is given
/// no secret file.
pub const SECRET_ENV: &str = "FERRY_SECRET";

/// Environment variable naming a command-line client's secret file.
pub const SECRET_FILE_ENV: &str = "FERRY_SECRET_FILE";

/// A connected, handshaken session with a server. Cheap to clone.
#[derive(Clone)]
pub struct Client {
    inner: Arc<Inner>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    // Every critical section leaves the data consistent; poisoning carries nothing.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Client {
    /// Connects to `host:port` over the transport `choice` asks for and completes the
    /// handshake. `Auto` tries RDMA first where this machine has an RDMA device and
    /// falls back to TCP when the server cannot be reached that way.
    pub async fn connect(
        host: &str,
        port: u16,
        choice: TransportChoice,
    ) -> Result<Client, ClientError> {
        Client::connect_with(host, port, choice, Credentials::none()).await
    }

    /// [`Client::connect`], proving `credentials` to the server: each share's secret
    /// is proved by the first request that names the share.
    pub async fn connect_with(
        host: &str,
        port: u16,
        choice: TransportChoice,
        credentials: Credentials,
    ) -> Result<Client, ClientError> {
        let addr = if host.contains(':') {
            format!("[{host}]:{port}")
        } else {
            format!("{host}:{port}")
        };
        let connect_err = |cause: String| ClientError::Connect {
            addr: addr.clone(),
            cause,
        };
        let addrs: Vec<_> = tokio::net::lookup_host((host, port))
            .await
            .map_err(|_| connect_err("no such host".into()))?
            .collect();
        if addrs.is_empty() {
            return Err(connect_err("no such host".into()));
        }
        if choice != TransportChoice::Tcp {
            match connect_rdma(&addrs).await {
                Ok(t) => return Client::start_with(t, addr, credentials).await,
                Err(cause) if choice == TransportChoice::Rdma => return Err(connect_err(cause)),
                Err(cause) => tracing::info!("not using RDMA to {addr}: {cause}; trying TCP"),
            }
        }
        let mut last = String::new();
        for a in addrs {
            match tokio::time::timeout(CONNECT_TIMEOUT, Tcp::connect(a)).await {
                Ok(Ok(t)) => {
                    return Client::start_with(Arc::new(t), addr, credentials).await;
                }
                Ok(Err(TransportError::Io { source, .. })) => last = describe_connect(&source),
                Ok(Err(e)) => last = e.to_string(),
                Err(_) => last = format!("timed out after {CONNECT_TIMEOUT:?}"),
            }
        }
        Err(connect_err(last))
    }

    /// Runs the handshake over an established transport (any backend, or a test
    /// wrapper); `addr` names the server in messages.
    pub async fn start(transport: SharedTransport, addr: String) -> Result<Client, ClientError> {
        Client::start_with(transport, addr, Credentials::none()).await
    }

    /// [`Client::start`] with `credentials`.
    pub async fn start_with(
        transport: SharedTransport,
        addr: String,
        credentials: Credentials,
    ) -> Result<Client, ClientError> {
        let (tx, rx) = oneshot::channel();
        let nonce = ferry_common::auth::fresh_nonce();
        let key_share = match credentials.encryption {
            Encryption::Off => None,
            _ => Some(KeyShare::generate().map_err(|e| ClientError::Handshake {
                addr: addr.clone(),
                cause: e.to_string(),
                refused: None,
            })?),
        };
        let offer = credentials.offer(key_share.as_ref());
        let sealed = Sealed::new(transport);
        let mut session = ClientSession::with_offer(Instant::now(), SOFTWARE, nonce, offer);
        session.set_liveness(credentials.liveness);
        let inner = Arc::new(Inner {
            transport: sealed.clone(),
            sealed,
            key_share: Mutex::new(key_share),
            session: Mutex::new(session),
            wake: Notify::new(),
            waiters: Mutex::new(Waiters::default()),
            connected: Mutex::new(Some(tx)),
            welcome: Mutex::new(None),
            negotiated: Mutex::new(None),
            buffers: Mutex::new(Vec::new()),
            addr: addr.clone(),
            credentials,
            proofs: Mutex::new(HashMap::new()),
            share_hashes: Mutex::new(HashMap::new()),
            hashes_used: Mutex::new(Vec::new()),
        });
        tokio::spawn(drive(inner.clone()));
        tokio::spawn(watch_liveness(Arc::downgrade(&inner)));
        flush(&inner).await;
        match rx.await {
            Ok(Ok(w)) => {
                *lock(&inner.welcome) = Some(w);
                *lock(&inner.negotiated) = lock(&inner.session).negotiated();
                Ok(Client { inner })
            }
            Ok(Err((cause, refused))) => Err(ClientError::Handshake {
                addr,
                cause,
                refused,
            }),
            Err(_) => Err(ClientError::Handshake {
                addr,
                cause: "connection closed during the handshake".into(),
                refused: None,
            }),
        }
    }

    /// The server's welcome.
    pub fn welcome(&self) -> Welcome {
        lock(&self.inner.welcome)
            .clone()
            .expect("a Client exists only after the welcome")
    }

    /// What the handshake agreed on (`None` only if the session ended during the
    /// handshake's last step).
    /// The cipher suite protecting the session, if it is encrypted.
    pub fn encryption(&self) -> Option<Suite> {
        self.inner.sealed.suite()
    }

    /// What the handshake agreed on.
    pub fn negotiated(&self) -> Option<Negotiated> {
        *lock(&self.inner.negotiated)
    }

    /// Whether the session negotiated the `meta` capability, without which
    /// [`Client::set_meta`] and [`Client::list_dir_meta`] are refused unsent.
    pub fn has_meta(&self) -> bool {
        self.negotiated().is_some_and(|n| n.meta)
    }

    /// Whether the session negotiated the `dirs` capability, without which
    /// [`Client::make_dirs`] and [`Client::set_attr_batch`] are refused unsent.
    pub fn has_dirs(&self) -> bool {
        self.negotiated().is_some_and(|n| n.dirs)
    }

    /// Whether the session negotiated the `finish` capability, without which
    /// [`Client::file_finish`] is refused unsent.
    pub fn has_finish(&self) -> bool {
        self.negotiated().is_some_and(|n| n.finish)
    }

    /// Fails unless the server's choice `algorithm` for a manifest or transfer is one
    /// this session offered.
    pub fn check_algorithm(&self, algorithm: HashAlgorithm) -> Result<(), ClientError> {
        let offered = self
            .negotiated()
            .is_some_and(|n| n.accepted.contains(algorithm));
        if offered {
            return Ok(());
        }
        Err(ClientError::Protocol(ProtoError::Transfer(format!(
            "the server sent {algorithm} hashes, which this client did not offer"
        ))))
    }

    /// Notes that a file moved with chunk hashes in `algorithm` (a resumed upload keeps
    /// the one it started with, a download gets the record's).
    pub fn used_hash(&self, algorithm: HashAlgorithm) {
        let mut used = lock(&self.inner.hashes_used);
        if !used.contains(&algorithm) {
            used.push(algorithm);
        }
    }

    /// The algorithms files of this session moved in, in [`HashAlgorithm::SUPPORTED`]
    /// order.
    pub fn hashes_used(&self) -> Vec<HashAlgorithm> {
        let used = lock(&self.inner.hashes_used);
        HashAlgorithm::SUPPORTED
            .iter()
            .copied()
            .filter(|a| used.contains(a))
            .collect()
    }

    /// The algorithm uploads to `share` hash in (the share's own, else the session's),
    /// asked once per share and session ([`Request::ShareInfo`]).
    pub async fn share_hash(&self, share: &str) -> Result<HashAlgorithm, ClientError> {
        if let Some(&a) = lock(&self.inner.share_hashes).get(share) {
            return Ok(a);
        }
        let algorithm = match self
            .call(Request::ShareInfo {
                share: share.into(),
            })
            .await?
        {
            Response::ShareInfo { algorithm } => algorithm,
            other => return Err(unexpected(other)),
        };
        self.check_algorithm(algorithm)?;
        lock(&self.inner.share_hashes).insert(share.into(), algorithm);
        Ok(algorithm)
    }

    /// The transport (for registering memory).
    pub fn transport(&self) -> &SharedTransport {
        &self.inner.transport
    }

    /// `host:port` of the server.
    pub fn addr(&self) -> &str {
        &self.inner.addr
    }

    /// Since when requests have waited with nothing at all heard from the server
    /// (no response, no answer to a liveness probe); `None` while nothing waits. What
    /// tells a hung server from a busy one, which keeps answering probes.
    pub fn silent_since(&self) -> Option<Instant> {
        lock(&self.inner.session).silent_since()
    }

    /// Sends `req` and waits for its response; a [`Response::Error`] becomes
    /// [`ClientError::Remote`]. If `req` names a share this session has a secret for
    /// and has not yet proved, the proof goes first.
    pub async fn call(&self, req: Request) -> Result<Response, ClientError> {
        if let Some(share) = req.share() {
            if !matches!(req, Request::Auth { .. }) {
                self.authenticate(share).await?;
            }
        }
        self.call_raw(crate::posix::wrap(self, req)).await
    }

    /// Proves this session knows `share`'s secret (once per session; later calls
    /// return the first outcome). Without a secret for `share` it does nothing: the
    /// server then answers requests with `AuthRequired` unless the share is open.
    pub async fn authenticate(&self, share: &str) -> Result<(), ClientError> {
        let Some(secret) = self.inner.credentials.for_share(share) else {
            return Ok(());
        };
        let cell = lock(&self.inner.proofs)
            .entry(share.to_string())
            .or_default()
            .clone();
        // The attempt's own error, for the call that made it; the others get a copy.
        let mut mine = None;
        let outcome = cell
            .get_or_init(|| async {
                self.prove(share, secret).await.map_err(|e| {
                    let copy = match &e {
                        ClientError::Remote(r) => r.clone(),
                        other => RemoteError {
                            kind: ErrorKind::AuthFailed,
                            message: format!("authentication for share '{share}' failed: {other}"),
                        },
                    };
                    mine = Some(e);
                    copy
                })
            })
            .await;
        match (outcome, mine) {
            (Ok(()), _) => Ok(()),
            (Err(_), Some(e)) => Err(e),
            (Err(copy), None) => Err(ClientError::Remote(copy.clone())),
        }
    }

    /// One proof of `share`'s secret; the session checks the server's own proof.
    async fn prove(&self, share: &str, secret: &Secret) -> Result<(), ClientError> {
        match self
            .exchange(|s| s.authenticate(Instant::now(), share, secret))
            .await?
        {
            Response::Authenticated { proof: Some(_) } => Ok(()),
            Response::Authenticated { proof: None } => {
                tracing::info!(
                    "{}: share '{share}' is served without a secret",
                    self.addr()
                );
                Ok(())
            }
            other => Err(unexpected(other)),
        }
    }

    async fn call_raw(&self, req: Request) -> Result<Response, ClientError> {
        // What the server would refuse as malformed (closing the session) fails here,
        // alone.
        codec::validate_request(&req).map_err(ClientError::Limit)?;
        self.exchange(|s| s.request(Instant::now(), req)).await
    }

    /// Queues one request with `queue` (which returns its id), sends it and waits for
    /// its answer; a [`Response::Error`] becomes [`ClientError::Remote`].
    async fn exchange(
        &self,
        queue: impl FnOnce(&mut ClientSession) -> Result<u64, ProtoError>,
    ) -> Result<Response, ClientError> {
        let (tx, rx) = oneshot::channel();
        let sooner = {
            let mut session = lock(&self.inner.session);
            let mut waiters = lock(&self.inner.waiters);
            if let Some(reason) = &waiters.closed {
                return Err(ClientError::Disconnected(reason.clone()));
            }
            let before = session.poll_timeout();
            let id = queue(&mut session)?;
            // Registered while the session is locked: the driver cannot see the
            // response before the waiter exists.
            waiters.map.insert(id, tx);
            session
                .poll_timeout()
                .is_some_and(|t| before.is_none_or(|b| t < b))
        };
        if sooner {
            // The request started the liveness clock: the driver must wake for it.
            self.inner.wake.notify_one();
        }
        flush(&self.inner).await;
        match rx.await {
            Ok(Ok(Response::Error(e))) => Err(ClientError::Remote(e)),
            Ok(r) => r,
            Err(_) => Err(ClientError::Disconnected("connection closed".into())),
        }
    }

    /// Closes the connection.
    pub fn close(&self) {
        self.inner.transport.close();
    }

    /// Takes a pooled buffer of at least `len` bytes, or makes one.
    pub(crate) fn take_buffer(&self, len: usize) -> Result<Arc<Buffer>, std::io::Error> {
        let mut pool = lock(&self.inner.buffers);
        match pool.iter().position(|b| b.len() >= len) {
            Some(i) => Ok(pool.swap_remove(i)),
            None => Buffer::new(len),
        }
    }

    /// Returns a buffer to the pool.
    pub(crate) fn give_buffer(&self, buf: Arc<Buffer>) {
        lock(&self.inner.buffers).push(buf);
    }

    /// Attributes of `path` in `share`.
    pub async fn stat(&self, share: &str, path: &str, follow: bool) -> Result<Attr, ClientError> {
        let req = Request::Stat {
            share: share.into(),
            path: path.into(),
            follow,
        };
        match self.call(req).await? {
            Response::Attr(a) => Ok(a),
            other => Err(unexpected(other)),
        }
    }

    /// Every entry of a directory (all pages).
    pub async fn list_dir(&self, share: &str, path: &str) -> Result<Vec<DirEntry>, ClientError> {
        let mut all = Vec::new();
        let request = |cursor| Request::ListDir {
            share: share.into(),
            path: path.into(),
            cursor,
        };
        self.paged(request, |answer| match answer {
            Response::Dir { entries, next } => {
                all.extend(entries);
                Ok(next)
            }
            other => Err(unexpected(other)),
        })
        .await?;
        Ok(all)
    }

    /// Sends `request(cursor)` from cursor 0 on, handing each answer to `page`, which
    /// keeps what it holds and returns the next page's cursor (`None` after the last).
    /// A cursor that does not move forward is a protocol error (a server cannot make
    /// this loop forever).
    async fn paged(
        &self,
        request: impl Fn(u64) -> Request,
        mut page: impl FnMut(Response) -> Result<Option<u64>, ClientError>,
    ) -> Result<(), ClientError> {
        let mut cursor = 0;
        loop {
            match page(self.call(request(cursor)).await?)? {
                Some(n) if n > cursor => cursor = n,
                Some(_) => return Err(unexpected(Response::Ok)),
                None => return Ok(()),
            }
        }
    }

    /// Asks this server (a cluster node) to fetch `share`/`path` from the node at
    /// `from` and publish it here, verified against `manifest`. Needs the `cluster`
    /// capability (see [`Client::negotiated`]).
    pub async fn replicate(
        &self,
        share: &str,
        path: &str,
        from: &str,
        size: u64,
        manifest: ferry_common::msg::Hash256,
    ) -> Result<(), ClientError> {
        let req = Request::Replicate {
            share: share.into(),
            path: path.into(),
            from: from.into(),
            size,
            manifest,
        };
        match self.call(req).await? {
            Response::Committed { size: got } if got == size => Ok(()),
            other => Err(unexpected(other)),
        }
    }

    /// Creates a directory.
    pub async fn mkdir(
        &self,
        share: &str,
        path: &str,
        mode: u32,
        exist_ok: bool,
    ) -> Result<(), ClientError> {
        let req = Request::Mkdir {
            share: share.into(),
            path: path.into(),
            mode,
            exist_ok,
        };
        self.call(req).await.and_then(expect_ok)
    }

    /// Creates (or atomically replaces) a symlink.
    pub async fn symlink(&self, share: &str, path: &str, target: &str) -> Result<(), ClientError> {
        let req = Request::Symlink {
            share: share.into(),
            path: path.into(),
            target: target.into(),
        };
        self.call(req).await.and_then(expect_ok)
    }

    /// Every entry of a directory (all pages) with its numeric owner, and the owner of
    /// the directory itself (see [`Request::ListDirMeta`]). Needs the `meta`
    /// capability ([`Client::has_meta`]).
    pub async fn list_dir_meta(
        &self,
        share: &str,
        path: &str,
    ) -> Result<(Owner, Vec<(DirEntry, Owner)>), ClientError> {
        self.need_meta()?;
        let mut all = Vec::new();
        let mut dir_owner = None;
        let request = |cursor| Request::ListDirMeta {
            share: share.into(),
            path: path.into(),
            cursor,
        };
        self.paged(request, |answer| match answer {
            Response::DirMeta {
                dir,
                entries,
                owners,
                next,
            } if owners.len() == entries.len() => {
                dir_owner.get_or_insert(dir);
                all.extend(entries.into_iter().zip(owners));
                Ok(next)
            }
            other => Err(unexpected(other)),
        })
        .await?;
        // A listing always has a first page, which names the directory's owner.
        let dir = dir_owner.ok_or_else(|| unexpected(Response::Ok))?;
        Ok((dir, all))
    }

    /// Sets numeric owners and/or mtimes of existing entries of `share` in one request
    /// (see [`Request::SetMeta`]; the server applies owners only if it runs as root):
    /// one result per entry, in order, each failing alone. Needs the `meta` capability
    /// ([`Client::has_meta`]) and at most [`META_BATCH_MAX`] entries of at most
    /// [`BATCH_MAX_PATH_BYTES`] path bytes in all; otherwise refused here, unsent.
    pub async fn set_meta(
        &self,
        share: &str,
        entries: Vec<MetaEntry>,
    ) -> Result<Vec<Result<(), RemoteError>>, ClientError> {
        self.need_meta()?;
        let path_bytes: usize = entries.iter().map(|e| e.path.len()).sum();
        if entries.len() > META_BATCH_MAX || path_bytes > BATCH_MAX_PATH_BYTES {
            return Err(ClientError::Usage(format!(
                "a metadata batch of {} entries and {path_bytes} path bytes exceeds the request limits",
                entries.len()
            )));
        }
        let n = entries.len();
        let req = Request::SetMeta {
            share: share.into(),
            entries,
        };
        self.call_results(req, n).await
    }

    /// Makes each of `dirs` of `share` in order, a directory already there counting as
    /// made (see [`Request::MakeDirs`]): one result per directory, each failing alone.
    /// Needs the `dirs` capability ([`Client::has_dirs`]) and at most
    /// [`META_BATCH_MAX`] directories of at most [`BATCH_MAX_PATH_BYTES`] path bytes in
    /// all; otherwise refused here, unsent.
    pub async fn make_dirs(
        &self,
        share: &str,
        dirs: Vec<NewDir>,
    ) -> Result<Vec<Result<(), RemoteError>>, ClientError> {
        let paths = dirs.iter().map(|d| d.path.len());
        self.check_dirs_batch("directory", dirs.len(), paths.sum())?;
        let n = dirs.len();
        let req = Request::MakeDirs {
            share: share.into(),
            dirs,
        };
        self.call_results(req, n).await
    }

    /// Sets owners (applied only by a server running as root), modes and mtimes of
    /// existing entries of `share` in one request (see [`Request::SetAttrBatch`]): one
    /// result per entry, in order, each failing alone. Needs the `dirs` capability and
    /// the limits of [`Client::make_dirs`]; otherwise refused here, unsent.
    pub async fn set_attr_batch(
        &self,
        share: &str,
        entries: Vec<AttrEntry>,
    ) -> Result<Vec<Result<(), RemoteError>>, ClientError> {
        let paths = entries.iter().map(|e| e.path.len());
        self.check_dirs_batch("attribute", entries.len(), paths.sum())?;
        let n = entries.len();
        let req = Request::SetAttrBatch {
            share: share.into(),
            entries,
        };
        self.call_results(req, n).await
    }

    /// Refuses a directory batch (`what`: its kind) of `n` entries and `path_bytes`
    /// path bytes that the session or the request limits do not allow.
    fn check_dirs_batch(&self, what: &str, n: usize, path_bytes: usize) -> Result<(), ClientError> {
        if !self.has_dirs() {
            return Err(ClientError::Usage(format!(
                "the server at {} does not support the directory batches",
                self.inner.addr
            )));
        }
        if n > META_BATCH_MAX || path_bytes > BATCH_MAX_PATH_BYTES {
            return Err(ClientError::Usage(format!(
                "a {what} batch of {n} entries and {path_bytes} path bytes exceeds the request limits"
            )));
        }
        Ok(())
    }

    /// Sends `req`, answered by one result per entry (`n` of them).
    async fn call_results(
        &self,
        req: Request,
        n: usize,
    ) -> Result<Vec<Result<(), RemoteError>>, ClientError> {
        match self.call(req).await? {
            Response::MetaSet { results } if results.len() == n => {
                Ok(results.into_iter().map(|r| r.map_or(Ok(()), Err)).collect())
            }
            other => Err(unexpected(other)),
        }
    }

    fn need_meta(&self) -> Result<(), ClientError> {
        if self.has_meta() {
            Ok(())
        } else {
            Err(ClientError::Usage(format!(
                "the server at {} does not support the metadata requests",
                self.inner.addr
            )))
        }
    }

    /// Sets mode and/or mtime.
    pub async fn set_attr(
        &self,
        share: &str,
        path: &str,
        mode: Option<u32>,
        mtime: Option<Timestamp>,
    ) -> Result<(), ClientError> {
        let req = Request::SetAttr {
            share: share.into(),
            path: path.into(),
            mode,
            mtime,
        };
        self.call(req).await.and_then(expect_ok)
    }
}

impl Client {
    /// Maps `path` for one-sided reads: the server registers the file read-only and
    /// returns its regions, version and manifest region (see [`MappedFile`]). Release it
    /// with [`Client::map_release`]; the server also releases it when the connection
    /// ends.
    pub async fn map_open(
        &self,
        share: &str,
        path: &str,
        chunk_bytes: u32,
    ) -> Result<MappedFile, ClientError> {
        let req = Request::MapOpen {
            share: share.into(),
            path: path.into(),
            chunk_bytes,
        };
        match self.call(req).await? {
            Response::Mapped(m) => Ok(*m),
            other => Err(unexpected(other)),
        }
    }

    /// Revokes a mapped file's registrations on the server.
    pub async fn map_release(&self, handle: u64) -> Result<(), ClientError> {
        self.call(Request::MapRelease { handle })
            .await
            .and_then(expect_ok)
    }

    /// Filesystem statistics of `share`.
    pub async fn statfs(&self, share: &str) -> Result<FsStat, ClientError> {
        match self
            .call(Request::StatFs {
                share: share.into(),
            })
            .await?
        {
            Response::FsStat(s) => Ok(s),
            other => Err(unexpected(other)),
        }
    }

    /// Removes the file, symlink or directory `path` of `share` (see
    /// [`Request::Remove`]): a symlink is removed, never its target; a directory must
    /// be empty unless `recursive`, which removes the tree below it without following
    /// symlinks. The share root and reserved names are refused.
    pub async fn remove(
        &self,
        share: &str,
        path: &str,
        recursive: bool,
    ) -> Result<(), ClientError> {
        let req = Request::Remove {
            share: share.into(),
            path: path.into(),
            recursive,
        };
        self.call(req).await.and_then(expect_ok)
    }

    /// Counts and sizes of the tree at `path` in `share`, computed by the server
    /// without following symlinks (see [`DiskUsage`]).
    pub async fn disk_usage(&self, share: &str, path: &str) -> Result<DiskUsage, ClientError> {
        let req = Request::DiskUsage {
            share: share.into(),
            path: path.into(),
        };
        match self.call(req).await? {
            Response::DiskUsage(u) => Ok(u),
            other => Err(unexpected(other)),
        }
    }

    /// Hard-links the regular file `from` to the new name `to` in `share` (see
    /// [`Request::Link`]); an existing `to` fails with [`ErrorKind::Exists`].
    pub async fn link(&self, share: &str, from: &str, to: &str) -> Result<(), ClientError> {
        let req = Request::Link {
            share: share.into(),
            from: from.into(),
            to: to.into(),
        };
        self.call(req).await.and_then(expect_ok)
    }

    /// Hard-links each `(from, to)` pair in `share` in one request (see
    /// [`Request::LinkBatch`]): one result per pair, in order, each link failing alone
    /// (an existing `to` with [`ErrorKind::Exists`], a file at its link limit with
    /// [`ErrorKind::TooManyLinks`]...). The batch must hold at most
    /// [`LINK_BATCH_MAX`] pairs and fit a request frame (see
    /// [`codec::link_batch_base_bytes`]); a larger one is refused here, unsent.
    pub async fn link_batch(
        &self,
        share: &str,
        links: Vec<(String, String)>,
    ) -> Result<Vec<Result<(), RemoteError>>, ClientError> {
        let bytes = codec::link_batch_base_bytes(share)
            + links
                .iter()
                .map(|(f, t)| codec::link_pair_bytes(f, t))
                .sum::<usize>();
        if links.len() > LINK_BATCH_MAX || bytes > codec::MAX_REQUEST_FRAME_BYTES {
            return Err(ClientError::Usage(format!(
                "a link batch of {} links and {bytes} bytes exceeds the request limits",
                links.len()
            )));
        }
        let n = links.len();
        let req = Request::LinkBatch {
            share: share.into(),
            links,
        };
        match self.call(req).await? {
            Response::LinkedBatch { results } if results.len() == n => {
                Ok(results.into_iter().map(|r| r.map_or(Ok(()), Err)).collect())
            }
            other => Err(unexpected(other)),
        }
    }

    /// Renames `from` to `to` in `share`, never replacing an existing `to` (see
    /// [`Request::Rename`]).
    pub async fn rename(&self, share: &str, from: &str, to: &str) -> Result<(), ClientError> {
        let req = Request::Rename {
            share: share.into(),
            from: from.into(),
            to: to.into(),
        };
        self.call(req).await.and_then(expect_ok)
    }

    /// The whole chunk manifest of the server's file `path` (every page of
    /// [`Request::Manifest`]), checked against its manifest hash.
    ///
    /// Invariant of the result: `hashes.len()` is the chunk count of `version.size` in
    /// chunks of `version.chunk_bytes`, and `manifest_id` of them is
    /// `version.manifest`. Pages of different versions (the file changed on the server
    /// while it was read) restart the listing, at most
    /// [`ferry_common::proto::manifest::MANIFEST_ATTEMPTS`] times in
    /// all; then it fails with [`ErrorKind::Changed`].
    pub async fn manifest(
        &self,
        share: &str,
        path: &str,
        chunk_bytes: u32,
    ) -> Result<(FileVersion, Vec<Hash256>), ClientError> {
        let mut reader = ManifestReader::new(share, path, chunk_bytes);
        while let Some(req) = reader.poll_request() {
            let page = self.call(req).await?;
            match reader.handle_page(page) {
                Ok(Some(manifest)) => return Ok(manifest),
                Ok(None) => {}
                Err(ManifestError::Changed(e)) => return Err(ClientError::Remote(e)),
                Err(ManifestError::Protocol(e)) => return Err(ClientError::Protocol(e)),
                Err(e) => return Err(ClientError::Protocol(ProtoError::Transfer(e.to_string()))),
            }
        }
        Err(ClientError::Protocol(ProtoError::Transfer(format!(
            "{path}: the manifest listing ended without a result"
        ))))
    }

    /// Has the server re-read the regular file `path` (its final component not
    /// followed) from its disk and compare every chunk with the manifest it recorded
    /// for that file (see [`VerifyReport`]). Takes as long as reading the file.
    pub async fn verify(&self, share: &str, path: &str) -> Result<VerifyReport, ClientError> {
        let req = Request::Verify {
            share: share.into(),
            path: path.into(),
        };
        match self.call(req).await? {
            Response::Verified(r) => Ok(r),
            other => Err(unexpected(other)),
        }
    }

    /// The server's counters (this request is counted in them).
    pub async fn server_stats(&self) -> Result<ServerStats, ClientError> {
        match self.call(Request::Stats).await? {
            Response::Stats(s) => Ok(s),
            other => Err(unexpected(other)),
        }
    }
}

/// An RDMA connection to the first of `addrs` that answers, or why there is none.
#[cfg(feature = "rdma")]
async fn connect_rdma(addrs: &[std::net::SocketAddr]) -> Result<SharedTransport, String> {
    use ferry_common::transport::rdma;
    rdma::available().map_err(|e| e.to_string())?;
    let mut last = String::new();
    for &a in addrs {
        match tokio::time::timeout(CONNECT_TIMEOUT, rdma::connect(a)).await {
            Ok(Ok(t)) => return Ok(Arc::new(t)),
            Ok(Err(e)) => last = e.to_string(),
            Err(_) => last = format!("RDMA connection timed out after {CONNECT_TIMEOUT:?}"),
        }
    }
    Err(last)
}

#[cfg(not(feature = "rdma"))]
async fn connect_rdma(_addrs: &[std::net::SocketAddr]) -> Result<SharedTransport, String> {
    Err("this build has no RDMA support (feature rdma off)".into())
}

fn describe_connect(e: &std::io::Error) -> String {
    match e.kind() {
        std::io::ErrorKind::ConnectionRefused => "connection refused".into(),
        std::io::ErrorKind::TimedOut => "connection timed out".into(),
        _ => e.to_string(),
    }
}

/// The error for a response of the wrong type.
pub(crate) fn unexpected(r: Response) -> ClientError {
    ClientError::Protocol(ferry_common::proto::ProtoError::Transfer(format!(
        "unexpected response {r:?}"
    )))
}

pub(crate) fn expect_ok(r: Response) -> Result<(), ClientError> {
    match r {
        Response::Ok => Ok(()),
        other => Err(unexpected(other)),
    }
}

/// Sends everything the session queued.
async fn flush(inner: &Inner) {
    let out: Vec<_> = {
        let mut s = lock(&inner.session);
        std::iter::from_fn(|| s.poll_transmit()).collect()
    };
    for msg in out {
        let Ok(bytes) = codec::encode(&msg) else {
            continue;
        };
        if inner.transport.send(bytes).await.is_err() {
            return;
        }
    }
}

/// Receives until the connection ends, completing waiters; then fails the rest.
async fn drive(inner: Arc<Inner>) {
    // The session's own reason, when it closed itself.
    let mut closed_by = None;
    let reason = loop {
        let deadline = lock(&inner.session).poll_timeout();
        let sleep = async {
            match deadline {
                Some(d) => tokio::time::sleep_until(d.into()).await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            received = inner.transport.recv() => match received {
                Ok(Some(bytes)) => match codec::decode(&bytes) {
                    Ok(msg) => {
                        let _ = lock(&inner.session).handle_message(Instant::now(), msg);
                    }
                    Err(e) => break format!("malformed message from server: {e}"),
                },
                Ok(None) => break "server closed the connection".to_string(),
                Err(e) => break e.to_string(),
            },
            () = sleep => lock(&inner.session).handle_timeout(Instant::now()),
            // A request was queued: the deadline is read again.
            () = inner.wake.notified() => {}
        }
        if let Some(reason) = pump(&inner) {
            let text = reason.to_string();
            closed_by = Some(reason);
            break text;
        }
        flush(&inner).await;
    };
    // A session the liveness watch closed says why, whatever the transport said after.
    if let Some(r) = lock(&inner.session).close_reason() {
        closed_by.get_or_insert_with(|| r.clone());
    }
    let reason = closed_by.as_ref().map_or(reason, ToString::to_string);
    end_session(&inner, &reason, closed_by.as_ref());
}

/// Runs the session's timers beside [`drive`], which can be held up in a send to a
/// server that stopped reading: a session the silence limit closes is ended here, its
/// waiting calls failed and its transport closed (which fails the held-up send).
async fn watch_liveness(inner: std::sync::Weak<Inner>) {
    loop {
        tokio::time::sleep(LIVENESS_TICK).await;
        let Some(inner) = inner.upgrade() else {
            return;
        };
        if lock(&inner.waiters).closed.is_some() {
            return;
        }
        let now = Instant::now();
        let (fired, closed) = {
            let mut s = lock(&inner.session);
            let due = s.poll_timeout().is_some_and(|t| t <= now);
            if due {
                s.handle_timeout(now);
            }
            (due, s.close_reason().cloned())
        };
        if let Some(reason) = closed {
            end_session(&inner, &reason.to_string(), Some(&reason));
            return;
        }
        if fired {
            // A probe, queued: sent even if the driver is held up.
            tokio::spawn(async move { flush(&inner).await });
        }
    }
}

/// Ends the session for `reason` (the session's own, `closed_by`, if it closed
/// itself): closes the transport, fails the handshake if it was still waiting and
/// every waiting call. Invariant: after the first call the waiters stay closed and
/// empty; later calls change nothing.
fn end_session(inner: &Inner, reason: &str, closed_by: Option<&ProtoError>) {
    inner.transport.close();
    if let Some(tx) = lock(&inner.connected).take() {
        let refused = match closed_by {
            Some(ProtoError::Refused(e)) => Some(e.kind),
            _ => None,
        };
        let _ = tx.send(Err((reason.to_owned(), refused)));
    }
    let waiters: Vec<Waiter> = {
        let mut w = lock(&inner.waiters);
        w.closed.get_or_insert_with(|| reason.to_owned());
        w.map.drain().map(|(_, w)| w).collect()
    };
    for w in waiters {
        let error = match closed_by {
            Some(ProtoError::ServerNotAuthentic(share)) => ClientError::ServerNotAuthentic {
                addr: inner.addr.clone(),
                share: share.clone(),
            },
            Some(ProtoError::ServerSilent(after)) => ClientError::Hung {
                addr: inner.addr.clone(),
                after: *after,
            },
            _ => ClientError::Disconnected(reason.to_owned()),
        };
        let _ = w.send(Err(error));
    }
}

/// Arms the encryption layer if the welcome agreed to encrypt.
fn secure(inner: &Inner) -> Result<(), String> {
    let key_share = lock(&inner.key_share).take();
    let (negotiated, transcript) = {
        let s = lock(&inner.session);
        (s.negotiated(), s.transcript())
    };
    let (Some(e), Some(t)) = (negotiated.and_then(|n| n.encryption), transcript) else {
        return Ok(());
    };
    let k = key_share.ok_or("no key share for an encrypted welcome")?;
    let rekey = e.rekey.then_some(inner.credentials.rekey);
    let keys = k
        .agree(&e.server_key, &t, e.suite, true, rekey)
        .map_err(|e| e.to_string())?;
    inner.sealed.arm(keys).map_err(|e| e.to_string())
}

/// Acts on session events; returns a reason once the session closed.
fn pump(inner: &Inner) -> Option<ProtoError> {
    loop {
        let event = lock(&inner.session).poll_event()?;
        match event {
            ClientEvent::Connected(w) => {
                // Sealed from the first message after the welcome: armed before
                // anyone may send.
                if let Err(e) = secure(inner) {
                    return Some(ProtoError::Incompatible(format!(
                        "cannot encrypt the session: {e}"
                    )));
                }
                if let Some(tx) = lock(&inner.connected).take() {
                    let _ = tx.send(Ok(w));
                }
            }
            ClientEvent::Response { id, body } => {
                if let Some(w) = lock(&inner.waiters).map.remove(&id) {
                    let _ = w.send(Ok(body));
                }
            }
            ClientEvent::Closed(reason) => return Some(reason),
        }
    }
}
