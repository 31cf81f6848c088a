//! The server half of a session.
//!
//! Call order: the driver feeds each received message to
//! [`ServerSession::handle_message`], sends everything from
//! [`ServerSession::poll_transmit`], calls [`ServerSession::handle_timeout`] when
//! [`ServerSession::poll_timeout`] passes, and acts on [`ServerSession::poll_event`]:
//! each [`ServerEvent::Request`] must be answered exactly once with
//! [`ServerSession::respond`]. After [`ServerEvent::Closed`] the driver sends what is
//! left to transmit and closes the connection.
//!
//! Access invariant: a request naming a share reaches the driver (and so any path
//! resolution or memory registration) only if the share is open or this session has
//! proved the share's secret with [`Request::Auth`]; [`Request::Stats`] only once some
//! share is usable. The session answers everything else itself: `AuthRequired` for a
//! request before its share's proof, `AuthFailed` for a wrong proof (then it closes).
//! Requests that name no share act on transfers and mapped files, which exist only
//! once a request naming an accessible share opened them: the connection's tables
//! ([`ConnState`]) admit each request before the driver sees it, and settle it from its
//! answer.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::Arc;
use std::time::Instant;

use super::caps::{self, HashAlgorithm, Negotiated, ServerEncryption};
use super::client::{handshake_transcript, message_name};
use super::conn::{ConnState, Grant};
use super::timer::{Timer, TimerTable};
use super::{ProtoError, HANDSHAKE_TIMEOUT, MAX_INFLIGHT_REQUESTS};
use crate::auth::{Nonce, ShareAccess};
use crate::codec::{self, CodecError};
use crate::msg::{
    ErrorKind, Hello, Message, RemoteError, Request, Response, Welcome, HELLO_MAGIC,
    MAX_WINDOW_CHUNKS, PROTOCOL_VERSION,
};
use crate::seal::{Encryption, PUBLIC_KEY_BYTES};

/// How each share the server exports is guarded, by share name. A name missing from
/// it is no share: requests naming it go to the driver, which answers `NoSuchShare`.
pub type AccessTable = HashMap<String, ShareAccess>;

/// What the server announces in its welcome, and how it guards its shares.
#[derive(Debug, Clone)]
pub struct ServerParams {
    /// Software name and version.
    pub software: String,
    /// Chunk size for transfers.
    pub chunk_bytes: u32,
    /// The secret (or openness) of every share.
    pub access: Arc<AccessTable>,
    /// Each share's encryption policy; a share missing from it is `preferred`.
    pub policies: Arc<HashMap<String, Encryption>>,
    /// Whether this server is a cluster node (it may choose [`caps::CLUSTER`]).
    pub cluster: bool,
}

impl ServerParams {
    /// The encryption policy of `share`.
    pub fn policy(&self, share: &str) -> Encryption {
        self.policies.get(share).copied().unwrap_or_default()
    }

    /// Whether the server asks for encryption itself: some share is not `off`.
    pub fn wants_encryption(&self) -> bool {
        self.access
            .keys()
            .any(|s| self.policy(s) != Encryption::Off)
    }
}

/// What the driver must act on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ServerEvent {
    /// The handshake finished; the client named its software.
    Ready {
        /// The client's software string.
        software: String,
    },
    /// A request admitted by the connection's tables ([`ConnState::admit`]), to
    /// perform and then answer with [`ServerSession::respond`].
    Request {
        /// The request's id.
        id: u64,
        /// The request.
        body: Request,
        /// What it may act on.
        grant: Grant,
    },
    /// The session proved a share's secret.
    Authenticated {
        /// The share.
        share: String,
    },
    /// The session was refused a share (wrong proof, or a request before the proof):
    /// the driver logs the peer.
    Denied {
        /// The share.
        share: String,
        /// Why, in words.
        reason: String,
    },
    /// The session is over.
    Closed(ProtoError),
}

#[derive(Debug, PartialEq, Eq)]
enum State {
    AwaitHello,
    Ready {
        client_nonce: Nonce,
        negotiated: Negotiated,
        /// What proofs use as the server nonce (bound to the transcript on an
        /// encrypted session).
        proof_nonce: Nonce,
    },
    Closed,
}

/// The server's protocol state machine for one connection.
#[derive(Debug)]
pub struct ServerSession {
    params: ServerParams,
    state: State,
    transmit: VecDeque<Message>,
    events: VecDeque<ServerEvent>,
    outstanding: HashSet<u64>,
    timers: TimerTable,
    nonce: Nonce,
    /// Shares this session proved the secret of.
    authenticated: HashSet<String>,
    /// Shares a request was refused for before their proof, so each is logged once.
    denied: HashSet<String>,
    /// Open transfers and mapped files, and the admission of requests naming them.
    conn: ConnState,
    /// This session's X25519 key share, if the driver can encrypt it.
    key_share: Option<[u8; PUBLIC_KEY_BYTES]>,
    /// The handshake's transcript, once the welcome is queued.
    transcript: Option<[u8; 32]>,
}

impl ServerSession {
    /// A session for a connection accepted at `now`; `nonce` must be fresh random
    /// bytes (see [`crate::auth::fresh_nonce`]), never reused for another session.
    pub fn new(now: Instant, params: ServerParams, nonce: Nonce) -> ServerSession {
        let mut timers = TimerTable::default();
        timers.set(Timer::Handshake, now + HANDSHAKE_TIMEOUT);
        ServerSession {
            conn: ConnState::new(params.chunk_bytes),
            params,
            state: State::AwaitHello,
            transmit: VecDeque::new(),
            events: VecDeque::new(),
            outstanding: HashSet::new(),
            timers,
            nonce,
            authenticated: HashSet::new(),
            denied: HashSet::new(),
            key_share: None,
            transcript: None,
        }
    }

    /// Lets the session be encrypted with `public` as the server's key share (the
    /// driver holds the private half, [`crate::seal::KeyShare`]). Call before the
    /// hello is handled; without it the session stays in the clear.
    pub fn set_key_share(&mut self, public: [u8; PUBLIC_KEY_BYTES]) {
        self.key_share = Some(public);
    }

    /// The handshake's transcript ([`crate::seal::transcript`]), once the welcome is
    /// queued.
    pub fn transcript(&self) -> Option<[u8; 32]> {
        self.transcript
    }

    /// Feeds one received message in. An error closes the session (also reported as
    /// [`ServerEvent::Closed`]).
    pub fn handle_message(&mut self, _now: Instant, msg: Message) -> Result<(), ProtoError> {
        let result = self.on_message(msg);
        if let Err(e) = &result {
            self.close(e.clone());
        }
        result
    }

    fn on_message(&mut self, msg: Message) -> Result<(), ProtoError> {
        match (&self.state, msg) {
            (State::AwaitHello, Message::Hello(h)) => self.on_hello(h),
            (
                &State::Ready {
                    client_nonce,
                    negotiated,
                    proof_nonce,
                },
                Message::Request { id, body },
            ) => self.on_request(id, body, negotiated, (client_nonce, proof_nonce)),
            (State::Closed, _) => Ok(()),
            (state, msg) => Err(ProtoError::Unexpected {
                got: message_name(&msg),
                state: if *state == State::AwaitHello {
                    "awaiting the client's hello"
                } else {
                    "in session"
                },
            }),
        }
    }

    /// The client's hello: negotiates the session's capabilities, queues the welcome
    /// and makes the session ready (a hello it cannot accept is refused).
    fn on_hello(&mut self, h: Hello) -> Result<(), ProtoError> {
        let mut negotiated = self
            .check_hello(h.magic, h.min_version, h.max_version)
            .and_then(|()| {
                caps::choose(&h.capabilities, HashAlgorithm::SUPPORTED).map_err(|m| self.refuse(m))
            })?;
        let server = self.key_share.map(|key| ServerEncryption {
            wants: self.params.wants_encryption(),
            key,
        });
        negotiated.encryption =
            caps::choose_encryption(&h.capabilities, server).map_err(|m| self.refuse(m))?;
        negotiated.cluster &= self.params.cluster;
        self.timers.stop(Timer::Handshake);
        self.conn.set_medium_batches(negotiated.medium_batches);
        let welcome = Welcome {
            version: PROTOCOL_VERSION,
            software: self.params.software.clone(),
            chunk_bytes: self.params.chunk_bytes,
            max_window_chunks: MAX_WINDOW_CHUNKS as u32,
            max_inflight_requests: MAX_INFLIGHT_REQUESTS,
            nonce: self.nonce,
            capabilities: negotiated.to_capabilities(),
        };
        let transcript = handshake_transcript(&h, &welcome)?;
        self.transcript = Some(transcript);
        let proof_nonce = match negotiated.encryption {
            Some(_) => crate::auth::bind_to_transcript(&self.nonce, &transcript),
            None => self.nonce,
        };
        self.state = State::Ready {
            client_nonce: h.nonce,
            negotiated,
            proof_nonce,
        };
        self.transmit.push_back(Message::Welcome(welcome));
        self.events.push_back(ServerEvent::Ready {
            software: h.software,
        });
        Ok(())
    }

    /// Request `id` in a ready session: `Auth` is answered here; any other request is
    /// refused unless the session negotiated its capability, the share allows it and
    /// the connection's tables admit it, else it goes to the driver.
    /// `(client_nonce, proof_nonce)` are what an `Auth`'s proof is bound to.
    fn on_request(
        &mut self,
        id: u64,
        body: Request,
        negotiated: Negotiated,
        nonces: (Nonce, Nonce),
    ) -> Result<(), ProtoError> {
        if self.outstanding.contains(&id) {
            return Err(ProtoError::DuplicateRequest(id));
        }
        if self.outstanding.len() >= MAX_INFLIGHT_REQUESTS as usize {
            return Err(ProtoError::TooManyRequests(MAX_INFLIGHT_REQUESTS));
        }
        if let Request::Auth { share, proof } = &body {
            let encrypted = negotiated.encryption.is_some();
            return self.authenticate(id, share, proof, nonces, encrypted);
        }
        if let Err(cap) = negotiated.permits(&body) {
            let refusal = RemoteError::new(
                ErrorKind::Protocol,
                format!("this request needs the '{cap}' capability, which the session did not negotiate"),
            );
            self.answer_refusal(id, refusal);
            return Ok(());
        }
        if let Some(refusal) = self.refusal(&body, negotiated.encryption.is_some()) {
            self.answer_refusal(id, refusal);
            return Ok(());
        }
        match self.conn.admit(id, &body) {
            Ok(grant) => {
                self.outstanding.insert(id);
                self.events
                    .push_back(ServerEvent::Request { id, body, grant });
            }
            Err(refusal) => self.answer_refusal(id, refusal),
        }
        Ok(())
    }

    /// Queues `refusal` as the answer to request `id`, which the driver never sees.
    fn answer_refusal(&mut self, id: u64, refusal: RemoteError) {
        self.transmit.push_back(Message::Response {
            id,
            body: Response::Error(refusal),
        });
    }

    /// Checks a hello's magic and version range; a hello this server cannot accept is
    /// answered with a refusal.
    fn check_hello(&mut self, magic: [u8; 4], min: u16, max: u16) -> Result<(), ProtoError> {
        if magic != HELLO_MAGIC {
            return Err(self.refuse("not a Ferry client (bad magic)".to_string()));
        }
        if !(min..=max).contains(&PROTOCOL_VERSION) {
            return Err(self.refuse(format!(
                "client speaks versions {min}..={max}, server speaks {PROTOCOL_VERSION}"
            )));
        }
        Ok(())
    }

    /// Queues the refusal of the session for `message`; returns the error to close with.
    fn refuse(&mut self, message: String) -> ProtoError {
        self.transmit.push_back(Message::Refused(RemoteError::new(
            ErrorKind::Protocol,
            message.clone(),
        )));
        ProtoError::Incompatible(message)
    }

    /// Feeds in a received message that did not decode (`error`), which closes the
    /// session. While awaiting the hello, one from a client of another protocol version
    /// (whose leading magic and version range still read) is refused by name.
    pub fn handle_undecodable(&mut self, _now: Instant, bytes: &[u8], error: CodecError) {
        let mut reason = ProtoError::Codec(error);
        if self.state == State::AwaitHello {
            if let Some((magic, min, max)) = codec::hello_head(bytes) {
                if let Err(refused) = self.check_hello(magic, min, max) {
                    reason = refused;
                }
            }
        }
        self.close(reason);
    }

    /// What the handshake agreed on, once the session is ready.
    pub fn negotiated(&self) -> Option<Negotiated> {
        match self.state {
            State::Ready { negotiated, .. } => Some(negotiated),
            _ => None,
        }
    }

    /// Checks a [`Request::Auth`] and answers it. A wrong proof is answered, reported
    /// as [`ServerEvent::Denied`] and closes the session.
    fn authenticate(
        &mut self,
        id: u64,
        share: &str,
        proof: &[u8; 32],
        (client_nonce, server_nonce): (Nonce, Nonce),
        encrypted: bool,
    ) -> Result<(), ProtoError> {
        let (client_nonce, server_nonce) = (&client_nonce, &server_nonce);
        let answer = match self.params.access.get(share) {
            None => Response::Error(RemoteError::new(
                ErrorKind::NoSuchShare,
                format!("no such share '{}'", share.escape_debug()),
            )),
            Some(_) if !encrypted && self.params.policy(share) == Encryption::Required => {
                Response::Error(self.needs_encryption(share))
            }
            Some(ShareAccess::Open) => Response::Authenticated { proof: None },
            Some(ShareAccess::Secret(secret)) => {
                if secret.check_client_proof(share, client_nonce, server_nonce, proof) {
                    self.authenticated.insert(share.to_string());
                    self.events.push_back(ServerEvent::Authenticated {
                        share: share.to_string(),
                    });
                    Response::Authenticated {
                        proof: Some(secret.server_proof(share, client_nonce, server_nonce)),
                    }
                } else {
                    let message = format!(
                        "wrong secret for share '{}': authentication failed",
                        share.escape_debug()
                    );
                    self.transmit.push_back(Message::Response {
                        id,
                        body: Response::Error(RemoteError::new(
                            ErrorKind::AuthFailed,
                            message.clone(),
                        )),
                    });
                    self.events.push_back(ServerEvent::Denied {
                        share: share.to_string(),
                        reason: "wrong secret".into(),
                    });
                    return Err(ProtoError::AuthFailed(share.escape_debug().to_string()));
                }
            }
        };
        self.transmit
            .push_back(Message::Response { id, body: answer });
        Ok(())
    }

    /// The refusal of a share that requires encryption to a session in the clear.
    fn needs_encryption(&mut self, share: &str) -> RemoteError {
        if self.denied.insert(share.to_string()) {
            self.events.push_back(ServerEvent::Denied {
                share: share.to_string(),
                reason: "session not encrypted".into(),
            });
        }
        RemoteError::new(
            ErrorKind::PermissionDenied,
            format!(
                "share '{}' requires an encrypted session, and this one is not encrypted: \
                 the client is older than encryption or ran with --encryption off, or \
                 something on the path removed its offer",
                share.escape_debug()
            ),
        )
    }

    /// Why `body` may not run on this session yet, if it may not.
    fn refusal(&mut self, body: &Request, encrypted: bool) -> Option<RemoteError> {
        if let Some(share) = body.share() {
            if !encrypted && self.params.policy(share) == Encryption::Required {
                let share = share.to_string();
                return Some(self.needs_encryption(&share));
            }
        }
        let usable = |s: &ServerSession, share: &str| {
            s.authenticated.contains(share)
                || !matches!(s.params.access.get(share), Some(ShareAccess::Secret(_)))
        };
        let share = match (body.share(), body) {
            (Some(share), _) if usable(self, share) => return None,
            (Some(share), _) => share.to_string(),
            (None, Request::Stats | Request::Counters) => {
                let any_open = self
                    .params
                    .access
                    .values()
                    .any(|a| matches!(a, ShareAccess::Open));
                if any_open || !self.authenticated.is_empty() {
                    return None;
                }
                return Some(RemoteError::new(
                    ErrorKind::AuthRequired,
                    "server statistics need an authenticated share",
                ));
            }
            (None, _) => return None,
        };
        if self.denied.insert(share.clone()) {
            self.events.push_back(ServerEvent::Denied {
                share: share.clone(),
                reason: "request before authentication".into(),
            });
        }
        Some(RemoteError::new(
            ErrorKind::AuthRequired,
            format!(
                "share '{}' requires a secret, and this session has not proved it",
                share.escape_debug()
            ),
        ))
    }

    /// Answers request `id`. Answers to requests that are not outstanding (the session
    /// closed meanwhile) are dropped.
    pub fn respond(&mut self, id: u64, body: Response) {
        if matches!(self.state, State::Ready { .. }) && self.outstanding.remove(&id) {
            self.conn.handle_response(id, &body);
            self.transmit.push_back(Message::Response { id, body });
        }
    }

    /// Fires expired timers.
    pub fn handle_timeout(&mut self, now: Instant) {
        if let Some(Timer::Handshake) = self.timers.take_expired(now) {
            self.close(ProtoError::HandshakeTimeout);
        }
    }

    fn close(&mut self, reason: ProtoError) {
        if self.state == State::Closed {
            return;
        }
        self.state = State::Closed;
        self.timers = TimerTable::default();
        self.outstanding.clear();
        self.conn.handle_closed();
        self.events.push_back(ServerEvent::Closed(reason));
    }

    /// Next message to send.
    pub fn poll_transmit(&mut self) -> Option<Message> {
        self.transmit.pop_front()
    }

    /// Next event to act on.
    pub fn poll_event(&mut self) -> Option<ServerEvent> {
        self.events.pop_front()
    }

    /// When [`ServerSession::handle_timeout`] must next be called.
    pub fn poll_timeout(&self) -> Option<Instant> {
        self.timers.next()
    }

    /// True once the session has ended.
    pub fn is_closed(&self) -> bool {
        self.state == State::Closed
    }

    /// The connection's tables of open transfers and mapped files.
    pub fn conn(&self) -> &ConnState {
        &self.conn
    }
}
