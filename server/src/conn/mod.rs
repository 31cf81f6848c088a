//! The per-connection driver: feeds received messages into the sans-IO
//! [`ServerSession`], runs each request the session admits on its own task, and sends
//! what the session queues. It makes no protocol decisions of its own: the session
//! decides which requests may run (authentication, the connection's tables of
//! transfers and mapped files, batch limits) and settles them from their answers.
//!
//! Each request family has its own module, which performs its requests:
//! [`transfer`] (windowed uploads and downloads), [`batch`] (batches of small files),
//! [`map`] (mapped files and manifests), [`file`] (files open for writing through
//! handles), [`namespace`] (attributes, listings, directories, links, moves) and
//! [`admin`] (counters, verification). Session requests (authentication) never leave
//! the session.
//!
//! Teardown invariant: when the connection ends, the driver closes the transport (so
//! every outstanding one-sided operation fails promptly), waits for every request task
//! to finish, then drops the open transfers (an unfinished upload's scratch file is
//! removed, its resumable partial and journal are kept for a later upload to resume),
//! the open file handles (a staged file that never took its name is removed) and the
//! open mapped files, which revokes their registrations.
//!
//! Bound: at most [`MAX_INFLIGHT_REQUESTS`] request tasks live at once, counted from
//! dispatch until their answer has been handed to the transport (which queues at most
//! `MAX_QUEUED_CTRL_BYTES` and then makes senders wait), and answers are sent by one
//! task at a time. So a peer that does not read its answers stops being read from: the
//! driver waits for a request slot before it takes the next message, and what the
//! connection holds stays bounded.
//!
//! Admission: until its session authenticates (proves a share's secret, asks for an
//! open share, or has a request admitted), the connection holds its [`Startup`]; it
//! must do so within the server's startup timeout of being accepted, or it is closed.
//! A wrong proof is reported to the server's failed-authentication limit.
//!
//! Counts: the connection, its open transfers and its registrations are counted in the
//! server's gauges until they are dropped, so the counts [`crate::Server::stats`]
//! reports fall back once every connection is gone.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use ferry_common::codec;
use ferry_common::msg::{HashAlgorithm, Message, RemoteError, Request, Response};
use ferry_common::proto::caps::{Algorithms, Negotiated};
use ferry_common::proto::conn::{Family, Grant};
use ferry_common::proto::server::{ServerEvent, ServerParams, ServerSession};
use ferry_common::proto::{ProtoError, MAX_INFLIGHT_REQUESTS};
use ferry_common::seal::KeyShare;
use ferry_common::transport::sealed::Sealed;
use ferry_common::transport::SharedTransport;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::task::{JoinError, JoinSet};

use crate::admission::Startup;
use crate::files::OpenFile;
use crate::gauge::Held;
use crate::map::MapTable;
use crate::pool::Pool;
use crate::share::Share;
use crate::traffic::Counted;
use crate::transfer::Transfer;
use crate::{Server, SOFTWARE};

mod admin;
mod batch;
mod blocking;
mod file;
mod lock;
mod map;
mod namespace;
#[cfg(feature = "cluster")]
mod replicate;
mod transfer;

/// How a session hashes for one share ([`Conn::hashing`]).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Hashing {
    /// The algorithms the client accepts manifests in.
    pub(crate) accept: Algorithms,
    /// The algorithm new data is hashed in.
    pub(crate) fresh: HashAlgorithm,
}

struct Conn {
    server: Arc<Server>,
    transport: SharedTransport,
    /// The encryption layer under `transport`, armed once the welcome is sent on an
    /// encrypted session.
    sealed: Arc<Sealed>,
    /// This session's key share until the handshake uses it.
    key_share: Mutex<Option<KeyShare>>,
    peer: String,
    session: Mutex<ServerSession>,
    /// The I/O state of each transfer the session's tables hold open, by id.
    transfers: Mutex<HashMap<u64, Arc<OpenTransfer>>>,
    /// The I/O state of each file handle the session's tables hold open, by handle.
    files: Mutex<HashMap<u64, Arc<OpenFile>>>,
    pool: Arc<Pool>,
    maps: MapTable,
    /// One permit per live request task ([`MAX_INFLIGHT_REQUESTS`]), held until its
    /// answer is handed to the transport.
    request_slots: Arc<Semaphore>,
    /// Held while sending, so answers go out one task at a time and an answer waits
    /// in the session (once) rather than in many senders' hands.
    sending: tokio::sync::Mutex<()>,
    /// The id this connection's file locks are held under; they go when it ends.
    lock_session: u64,
    /// Held until the session authenticates (see the module docs).
    startup: Mutex<Option<Startup>>,
    /// When the session must have authenticated by.
    startup_deadline: Instant,
    /// The address the connection counts against.
    source: IpAddr,
}

/// What a connection the server admitted holds from accept on.
pub(crate) struct Admitted {
    /// Its place under the connection limit, until everything it held is released.
    pub(crate) live: Held,
    /// Its place as a startup, until its session authenticates.
    pub(crate) startup: Startup,
    /// The address it counts against.
    pub(crate) source: IpAddr,
    /// When it was accepted.
    pub(crate) accepted: Instant,
}

/// A request the driver itself cannot perform. Each is mapped to the wire's
/// [`RemoteError`] in [`crate::error`], as the layers' errors are.
#[derive(Debug, thiserror::Error)]
pub(crate) enum ConnError {
    /// A request named a share the server does not serve.
    #[error("no such share '{}'", share.escape_debug())]
    NoSuchShare {
        /// The name as the client sent it.
        share: String,
    },
    /// The share fixes a hash algorithm for its new data that the client did not
    /// offer.
    #[error("share '{}' records its data with {required} chunk hashes (ferryd's configuration), which this client does not accept (it offered {offered})", share.escape_debug())]
    HashRefused {
        /// The share.
        share: String,
        /// The share's algorithm.
        required: HashAlgorithm,
        /// What the client offered.
        offered: String,
    },
    /// A request reached a family module that does not perform it: a bug in the
    /// routing, answered rather than panicking.
    #[error("request {0:?} reached the wrong handler")]
    Misrouted(Family),
    /// A transfer the session's tables hold but the driver has no state for: a bug,
    /// answered rather than panicking.
    #[error("no open transfer {transfer}")]
    NoState {
        /// The transfer's id.
        transfer: u64,
    },
    /// A file handle the session's tables hold but the driver has no state for: a
    /// bug, answered rather than panicking.
    #[error("no open file handle {handle}")]
    NoFile {
        /// The handle.
        handle: u64,
    },
    /// A transfer whose I/O state is not of the kind the session's tables admitted
    /// the request for: a bug, answered rather than panicking.
    #[error("transfer {transfer} is not of the kind its request needs")]
    WrongKind {
        /// The transfer's id.
        transfer: u64,
    },
    /// A blocking task of a request failed (it panicked or was cancelled).
    #[error("server task failed")]
    Task(#[source] JoinError),
    /// A request's blocking task could not act as its caller.
    #[error("cannot act as the caller")]
    Act(#[source] std::io::Error),
}

/// A transfer in a connection's table, counted in the server's open transfers until its
/// last reference (the table's or a request task's) is dropped.
struct OpenTransfer {
    // Field order is drop order: an upload's hidden file is let go of (its lock
    // released, a scratch file removed) before the count falls.
    transfer: Transfer,
    _counted: Held,
}

/// Serves one connection, `admitted` by the server, to the end. The session's handshake
/// must finish within `HANDSHAKE_TIMEOUT` of being accepted, its authentication within
/// the server's startup timeout.
pub(crate) async fn run(server: Arc<Server>, transport: SharedTransport, admitted: Admitted) {
    // Bound first, dropped last: the connection is counted until everything it held
    // (pool, transfers, mapped files, transport) is gone.
    let _live = admitted.live;
    let accepted = admitted.accepted;
    // Encryption sits under the counters: they count what the application moved.
    let sealed = Sealed::new(transport);
    // Every one-sided operation and control frame of the connection is counted.
    let transport = Counted::wrap(sealed.clone(), server.traffic.clone());
    let peer = transport.peer();
    let params = ServerParams {
        software: SOFTWARE.into(),
        chunk_bytes: server.chunk_bytes,
        access: server.access.clone(),
        policies: server.policies.clone(),
        cluster: server.cluster().is_some(),
    };
    let key_share = match KeyShare::generate() {
        Ok(k) => Some(k),
        Err(e) => {
            tracing::error!(peer = %peer, "cannot encrypt this session: {e}");
            None
        }
    };
    let mut session = ServerSession::new(accepted, params, ferry_common::auth::fresh_nonce());
    if let Some(k) = &key_share {
        session.set_key_share(k.public());
    }
    let pool = Pool::new(
        transport.clone(),
        server.chunk_bytes as usize,
        server.queue_depth,
        server.registrations.clone(),
    );
    let lock_session = server.lock_session();
    let conn = Arc::new(Conn {
        startup_deadline: accepted + server.startup_timeout(),
        session: Mutex::new(session),
        server,
        transport,
        sealed,
        key_share: Mutex::new(key_share),
        peer,
        transfers: Mutex::new(HashMap::new()),
        files: Mutex::new(HashMap::new()),
        pool,
        maps: MapTable::new(),
        request_slots: Arc::new(Semaphore::new(MAX_INFLIGHT_REQUESTS as usize)),
        sending: tokio::sync::Mutex::new(()),
        lock_session,
        startup: Mutex::new(Some(admitted.startup)),
        source: admitted.source,
    });
    tracing::info!(peer = %conn.peer, transport = conn.transport.kind().as_str(), "connection opened");
    let mut tasks = JoinSet::new();
    let reason = conn.drive(&mut tasks).await;
    conn.transport.close();
    while tasks.join_next().await.is_some() {}
    // No request of this connection runs any more: none can take a lock after this.
    let released = conn.server.locks().release_session(conn.lock_session);
    if released > 0 {
        tracing::info!(peer = %conn.peer, "released {released} file locks");
    }
    let open = std::mem::take(&mut *conn.transfers());
    if !open.is_empty() {
        tracing::info!(peer = %conn.peer, "dropping {} unfinished transfers", open.len());
    }
    // Removing staged files (and waiting for a reservation still being made) is
    // filesystem work: off the async threads.
    let _ = tokio::task::spawn_blocking(move || drop(open)).await;
    let files = std::mem::take(&mut *conn.files());
    if !files.is_empty() {
        tracing::info!(peer = %conn.peer, "dropping {} open file handles", files.len());
    }
    // Removing staged files is filesystem work: off the async threads.
    let _ = tokio::task::spawn_blocking(move || drop(files)).await;
    let maps = conn.maps.take_all();
    if !maps.is_empty() {
        tracing::info!(peer = %conn.peer, "releasing {} mapped files", maps.len());
    }
    // Deregistering large mappings can take a while on RDMA: off the async threads.
    let _ = tokio::task::spawn_blocking(move || drop(maps)).await;
    tracing::info!(peer = %conn.peer, "connection closed: {reason}");
}

impl Conn {
    fn session(&self) -> std::sync::MutexGuard<'_, ServerSession> {
        // Session methods do not panic on peer input; poisoning would mean a bug, and
        // the state is still the best we have.
        self.session.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn transfers(&self) -> std::sync::MutexGuard<'_, HashMap<u64, Arc<OpenTransfer>>> {
        self.transfers.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn files(&self) -> std::sync::MutexGuard<'_, HashMap<u64, Arc<OpenFile>>> {
        self.files.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Runs until the connection ends; returns why.
    async fn drive(self: &Arc<Self>, tasks: &mut JoinSet<()>) -> String {
        let mut stop = self.server.stop_signal();
        // The slot the next request will run in; taken before the next message is
        // read, so no message is read while every slot is busy.
        let mut slot = None;
        loop {
            if slot.is_none() {
                slot = tokio::select! {
                    permit = self.request_slots.clone().acquire_owned() => permit.ok(),
                    _ = stop.wait_for(|stopping| *stopping) => return "server shutting down".into(),
                };
            }
            let deadline = self.next_deadline();
            let sleep = async {
                match deadline {
                    Some(d) => tokio::time::sleep_until(d.into()).await,
                    None => std::future::pending().await,
                }
            };
            let mut malformed = None;
            tokio::select! {
                received = self.transport.recv() => match received {
                    Ok(Some(bytes)) => match codec::decode(&bytes) {
                        Ok(msg) => {
                            let open = self.asks_open_share(&msg);
                            let _ = self.session().handle_message(Instant::now(), msg);
                            if open {
                                self.authenticated();
                            }
                        }
                        Err(e) => {
                            tracing::warn!(peer = %self.peer, "malformed control message: {e}");
                            // A refusal of a hello of another version goes out first.
                            self.session().handle_undecodable(Instant::now(), &bytes, e.clone());
                            malformed = Some(format!("malformed control message: {e}"));
                        }
                    },
                    Ok(None) => return "peer closed the connection".into(),
                    Err(e) => return format!("transport error: {e}"),
                },
                () = sleep => self.session().handle_timeout(Instant::now()),
                _ = stop.wait_for(|stopping| *stopping) => return "server shutting down".into(),
            }
            if let Some(reason) = malformed {
                self.flush().await;
                return reason;
            }
            // Sending waits while the transport's queue is full (a peer that does not
            // read): no more requests are taken from it meanwhile, but shutdown is.
            let pumped = tokio::select! {
                closed = self.pump(tasks, &mut slot) => closed,
                _ = stop.wait_for(|stopping| *stopping) => return "server shutting down".into(),
            };
            if let Some(reason) = pumped {
                return reason;
            }
            if self.startup_expired(Instant::now()) {
                return format!(
                    "not authenticated within {:?}",
                    self.server.startup_timeout()
                );
            }
            while tasks.try_join_next().is_some() {}
        }
    }

    /// When the driver must next wake: the session's timer, or the startup deadline
    /// while the session has not authenticated.
    fn next_deadline(&self) -> Option<Instant> {
        let session = self.session().poll_timeout();
        let startup = self.startup().is_some().then_some(self.startup_deadline);
        match (session, startup) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// Whether the session has not authenticated and its time to do so is up.
    fn startup_expired(&self, now: Instant) -> bool {
        now >= self.startup_deadline && self.startup().is_some()
    }

    fn startup(&self) -> std::sync::MutexGuard<'_, Option<Startup>> {
        self.startup.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The session authenticated: it is no longer a startup.
    fn authenticated(&self) {
        self.startup().take();
    }

    /// Whether `msg` asks for an open share (one served without a secret), which
    /// authenticates a session as much as anything can.
    fn asks_open_share(&self, msg: &Message) -> bool {
        matches!(msg, Message::Request { body: Request::Auth { share, .. }, .. }
            if self.server.is_open(share))
    }

    /// Acts on every queued session event and sends what the session queued. A request
    /// runs in `slot` (or, should one message ever yield two requests, in a slot waited
    /// for here).
    async fn pump(
        self: &Arc<Self>,
        tasks: &mut JoinSet<()>,
        slot: &mut Option<OwnedSemaphorePermit>,
    ) -> Option<String> {
        let mut closed = None;
        loop {
            let event = self.session().poll_event();
            match event {
                None => break,
                Some(ServerEvent::Ready { software }) => {
                    tracing::debug!(peer = %self.peer, client = %software, "session ready");
                    // The welcome goes out in the clear; everything after it sealed.
                    self.flush().await;
                    if let Err(e) = self.secure() {
                        closed = Some(format!("cannot encrypt the session: {e}"));
                        break;
                    }
                }
                Some(ServerEvent::Authenticated { share }) => {
                    tracing::info!(peer = %self.peer, share = %share.escape_debug(), "authenticated");
                    self.authenticated();
                }
                Some(ServerEvent::Denied { share, reason }) => {
                    tracing::warn!(
                        peer = %self.peer,
                        share = %share.escape_debug(),
                        "refused peer: {reason}"
                    );
                }
                Some(ServerEvent::Request { id, body, grant }) => {
                    // Admitted by the session, a request naming a share may use it: the
                    // share needs no proof or has had it.
                    if body.share().is_some() {
                        self.authenticated();
                    }
                    let permit = match slot.take() {
                        Some(p) => Some(p),
                        None => self.request_slots.clone().acquire_owned().await.ok(),
                    };
                    let conn = self.clone();
                    tasks.spawn(async move {
                        let mut response = match conn.dispatch(body, grant).await {
                            Ok(r) => r,
                            Err(e) => Response::Error(e),
                        };
                        if !conn.posix() {
                            response.hide_nodes();
                        }
                        conn.session().respond(id, response);
                        conn.flush().await;
                        drop(permit);
                    });
                }
                Some(ServerEvent::Closed(reason)) => {
                    tracing::warn!(peer = %self.peer, "session closed: {reason}");
                    if let ProtoError::AuthFailed(_) = reason {
                        self.server.auth_failed(self.source);
                    }
                    closed = Some(reason.to_string());
                }
            }
        }
        self.flush().await;
        closed
    }

    /// Arms the encryption layer if the handshake agreed to encrypt (the welcome must
    /// have been sent, and nothing else after it).
    fn secure(&self) -> Result<(), String> {
        let key_share = self
            .key_share
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take();
        let (negotiated, transcript) = {
            let s = self.session();
            (s.negotiated(), s.transcript())
        };
        let (Some(e), Some(t), Some(k)) =
            (negotiated.and_then(|n| n.encryption), transcript, key_share)
        else {
            return Ok(());
        };
        let rekey = e.rekey.then(|| self.server.rekey());
        let keys = k
            .agree(&e.client_key, &t, e.suite, false, rekey)
            .map_err(|e| e.to_string())?;
        self.sealed.arm(keys).map_err(|e| e.to_string())?;
        tracing::info!(peer = %self.peer, suite = e.suite.name(), key_updates = e.rekey, "session encrypted");
        Ok(())
    }

    /// Sends every message the session has queued (waiting for the sender before,
    /// so a message queued now is sent before this returns).
    async fn flush(&self) {
        let _sending = self.sending.lock().await;
        let out: Vec<_> = {
            let mut s = self.session();
            std::iter::from_fn(|| s.poll_transmit()).collect()
        };
        for msg in out {
            match codec::encode(&msg) {
                Ok(bytes) => {
                    if self.transport.send(bytes).await.is_err() {
                        return;
                    }
                }
                Err(e) => tracing::error!(peer = %self.peer, "cannot encode a response: {e}"),
            }
        }
    }

    /// How this session hashes for `share`: the algorithms it accepts, and the one new
    /// data is hashed in (the share's own if its configuration fixes one, which the
    /// client must then accept; else the session's).
    fn hashing(&self, share: &Share) -> Result<Hashing, ConnError> {
        // Requests are admitted only once the handshake negotiated; the default is
        // what a session without a `hash` capability gets.
        let n = self.session().negotiated().unwrap_or(Negotiated {
            hash: HashAlgorithm::Sha256,
            accepted: Algorithms::of(&[HashAlgorithm::Sha256]),
            meta: false,
            medium_batches: false,
            write: false,
            cluster: false,
            dirs: false,
            finish: false,
            locks: false,
            xattr: false,
            falloc: false,
            posix: false,
            encryption: None,
        });
        let fresh = share.hash().unwrap_or(n.hash);
        if !n.accepted.contains(fresh) {
            let offered: Vec<&str> = HashAlgorithm::SUPPORTED
                .iter()
                .filter(|a| n.accepted.contains(**a))
                .map(|a| a.name())
                .collect();
            return Err(ConnError::HashRefused {
                share: share.name().into(),
                required: fresh,
                offered: offered.join(","),
            });
        }
        Ok(Hashing {
            accept: n.accepted,
            fresh,
        })
    }

    fn share(&self, name: &str) -> Result<Arc<Share>, ConnError> {
        self.server
            .share(name)
            .cloned()
            .ok_or_else(|| ConnError::NoSuchShare { share: name.into() })
    }

    /// Performs an admitted request in its family's module.
    async fn dispatch(
        self: &Arc<Self>,
        body: Request,
        grant: Grant,
    ) -> Result<Response, RemoteError> {
        self.server.count_request();
        if let Request::AsCaller { caller, request } = body {
            return match self.acting(&caller, &request, grant) {
                Some(acting) => crate::owners::scope(acting, self.perform(*request, grant)).await,
                None => self.perform(*request, grant).await,
            };
        }
        self.perform(body, grant).await
    }

    /// Whether the session negotiated `posix` (it sees special files as what they are).
    fn posix(&self) -> bool {
        self.session().negotiated().is_some_and(|n| n.posix)
    }

    /// Who `caller`'s `request` acts as: its share's policy (for a request on a
    /// handle, the share the handle was opened in); `None` runs it as ferryd.
    fn acting(
        &self,
        caller: &ferry_common::msg::Caller,
        request: &Request,
        grant: Grant,
    ) -> Option<crate::owners::Acting> {
        let share = match (request.share(), grant) {
            (Some(name), _) => self.share(name).ok()?,
            (None, Grant::File(handle)) => self.files().get(&handle)?.share().clone(),
            (None, _) => return None,
        };
        share.owners().acting(caller, share.root())
    }

    /// Performs an unwrapped request in its family's module.
    async fn perform(
        self: &Arc<Self>,
        body: Request,
        grant: Grant,
    ) -> Result<Response, RemoteError> {
        match Family::of(&body) {
            Family::Transfer => transfer::perform(self, body, grant).await,
            Family::Batch => batch::perform(self, body).await,
            Family::Map => map::perform(self, body, grant).await,
            Family::Namespace => namespace::perform(self, body).await,
            Family::Admin => admin::perform(self, body).await,
            Family::File => file::perform(self, body, grant).await,
            Family::Lock => lock::perform(self, body).await,
            // The session answers these itself; one reaching here is a bug there.
            Family::Session => Err(misrouted(&body).into()),
        }
    }
}

/// The error for a request that reached a module that does not perform it.
fn misrouted(body: &Request) -> ConnError {
    ConnError::Misrouted(Family::of(body))
}

/// Tells the peer why its session is refused with `Message::Refused(error)`, its only
/// message, and closes the connection once the peer has closed its side (reading and
/// discarding what it sends meanwhile, its `Hello`), so that the refusal is not lost to
/// a reset of a socket closed with unread data. The caller bounds the wait.
pub(crate) async fn refuse(transport: SharedTransport, error: RemoteError) {
    match codec::encode(&Message::Refused(error)) {
        Ok(bytes) => {
            let _ = transport.send(bytes).await;
        }
        Err(e) => tracing::error!("cannot encode a refusal: {e}"),
    }
    transport.close();
    while let Ok(Some(_)) = transport.recv().await {}
}
