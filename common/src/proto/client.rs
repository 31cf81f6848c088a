//! The client half of a session.
//!
//! Call order: [`ClientSession::new`] queues the `Hello`; the driver sends everything
//! from [`ClientSession::poll_transmit`], feeds each received message to
//! [`ClientSession::handle_message`], calls [`ClientSession::handle_timeout`] when
//! [`ClientSession::poll_timeout`] passes, and acts on [`ClientSession::poll_event`].
//! [`ClientSession::request`] may be called at any time: requests made before the
//! `Welcome`, or beyond the server's in-flight limit, wait in order inside the session.
//!
//! Liveness ([`Liveness`]): while requests are outstanding, a server that has sent
//! nothing for [`Liveness::probe_after`] is probed with a cheap request
//! ([`Request::Counters`], which every server answers from its connection task, with
//! its counters or a refusal: any answer proves it runs); the probe's answer is taken
//! here and never reported. A server silent for [`Liveness::silence_limit`] while
//! requests wait closes the session with [`ProtoError::ServerSilent`]. An idle session
//! (nothing outstanding) is never probed nor closed.

use std::collections::{HashMap, HashSet, VecDeque};
use std::time::{Duration, Instant};

use super::caps::{self, Negotiated, Offer};
use super::timer::{Timer, TimerTable};
use super::{ProtoError, HANDSHAKE_TIMEOUT, PROBE_AFTER, SERVER_SILENCE_LIMIT};
use crate::auth::{Nonce, Secret};
use crate::msg::{Hello, Message, Request, Response, Welcome, HELLO_MAGIC, PROTOCOL_VERSION};

/// How a session tells a live server from a hung one (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Liveness {
    /// Silence (with requests outstanding) after which the server is probed; below
    /// `silence_limit`, so that a live server's answer arrives in time.
    pub probe_after: Duration,
    /// Silence (with requests outstanding) after which the session ends as hung.
    pub silence_limit: Duration,
}

impl Default for Liveness {
    /// [`PROBE_AFTER`] and [`SERVER_SILENCE_LIMIT`].
    fn default() -> Liveness {
        Liveness {
            probe_after: PROBE_AFTER,
            silence_limit: SERVER_SILENCE_LIMIT,
        }
    }
}

impl Liveness {
    /// Probing after `silence_limit / 4` (at most [`PROBE_AFTER`]) and ending the
    /// session after `silence_limit` of silence.
    pub fn with_limit(silence_limit: Duration) -> Liveness {
        Liveness {
            probe_after: (silence_limit / 4).min(PROBE_AFTER),
            silence_limit,
        }
    }
}

/// What the driver must act on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ClientEvent {
    /// The server accepted the session.
    Connected(Welcome),
    /// The answer to request `id`.
    Response {
        /// The request's id.
        id: u64,
        /// The answer.
        body: Response,
    },
    /// The session is over; every outstanding request has failed.
    Closed(ProtoError),
}

#[derive(Debug)]
enum State {
    AwaitWelcome,
    Ready(Welcome, Negotiated),
    Closed,
}

/// The client's protocol state machine.
#[derive(Debug)]
pub struct ClientSession {
    state: State,
    transmit: VecDeque<Message>,
    events: VecDeque<ClientEvent>,
    outstanding: HashSet<u64>,
    queued: VecDeque<(u64, Request)>,
    next_id: u64,
    timers: TimerTable,
    nonce: Nonce,
    offer: Offer,
    /// `Auth` requests outstanding: the share and the secret whose server proof the
    /// answer must carry.
    proving: HashMap<u64, (String, Secret)>,
    /// The hello sent, kept for the transcript.
    hello: Hello,
    /// The transcript of the handshake, once connected.
    transcript: Option<[u8; 32]>,
    /// What proofs use as the server's nonce: the welcome's, bound to the transcript
    /// on an encrypted session ([`crate::auth::bind_to_transcript`]).
    proof_nonce: Nonce,
    liveness: Liveness,
    /// The liveness probe outstanding, if one is: its id is in `outstanding` too, and
    /// its answer is consumed here.
    probe: Option<u64>,
    /// Since when the server has owed an answer without sending anything: `None`
    /// while no request of the application waits.
    silent_since: Option<Instant>,
    /// Why the session closed, once it has.
    closed_by: Option<ProtoError>,
}

impl ClientSession {
    /// Starts a session at `now`, queuing the `Hello`. `nonce` must be fresh random
    /// bytes (see [`crate::auth::fresh_nonce`]), never reused for another session.
    pub fn new(now: Instant, software: &str, nonce: Nonce) -> ClientSession {
        Self::with_offer(now, software, nonce, Offer::default())
    }

    /// [`ClientSession::new`] offering the capabilities of `offer`.
    pub fn with_offer(now: Instant, software: &str, nonce: Nonce, offer: Offer) -> ClientSession {
        let mut timers = TimerTable::default();
        timers.set(Timer::Handshake, now + HANDSHAKE_TIMEOUT);
        let hello = Hello {
            magic: HELLO_MAGIC,
            min_version: PROTOCOL_VERSION,
            max_version: PROTOCOL_VERSION,
            software: software.chars().take(64).collect(),
            nonce,
            capabilities: offer.to_capabilities(),
        };
        ClientSession {
            state: State::AwaitWelcome,
            transmit: VecDeque::from([Message::Hello(hello.clone())]),
            hello,
            transcript: None,
            proof_nonce: [0; 32],
            events: VecDeque::new(),
            outstanding: HashSet::new(),
            queued: VecDeque::new(),
            next_id: 1,
            timers,
            nonce,
            offer,
            proving: HashMap::new(),
            liveness: Liveness::default(),
            probe: None,
            silent_since: None,
            closed_by: None,
        }
    }

    /// Uses `liveness` from now on (before the first request, normally).
    pub fn set_liveness(&mut self, liveness: Liveness) {
        self.liveness = liveness;
    }

    /// Since when requests have waited with nothing heard from the server (the start
    /// of the current silence); `None` while nothing waits or once closed.
    pub fn silent_since(&self) -> Option<Instant> {
        self.silent_since
    }

    /// The liveness policy in force.
    pub fn liveness(&self) -> Liveness {
        self.liveness
    }

    /// This session's nonce, as sent in the `Hello`.
    pub fn nonce(&self) -> &Nonce {
        &self.nonce
    }

    /// Queues `body` at `now` and returns the id its response will carry.
    pub fn request(&mut self, now: Instant, body: Request) -> Result<u64, ProtoError> {
        if matches!(self.state, State::Closed) {
            return Err(ProtoError::Unexpected {
                got: "request",
                state: "closed",
            });
        }
        let id = self.next_id;
        self.next_id += 1;
        self.queued.push_back((id, body));
        self.flush_queue(now);
        Ok(id)
    }

    /// Queues the proof that this session knows `share`'s secret ([`Request::Auth`])
    /// and returns the id its answer will carry. Only once connected (the proof binds
    /// the server's nonce). A server answers with its own proof, which is checked here:
    /// a wrong one closes the session with [`ProtoError::ServerNotAuthentic`], so no
    /// request of the share ever reaches an impostor; an open share is answered
    /// without one.
    pub fn authenticate(
        &mut self,
        now: Instant,
        share: &str,
        secret: &Secret,
    ) -> Result<u64, ProtoError> {
        let State::Ready(..) = &self.state else {
            return Err(ProtoError::Unexpected {
                got: "authentication",
                state: "not connected",
            });
        };
        let proof = secret.client_proof(share, &self.nonce, &self.proof_nonce);
        let id = self.request(
            now,
            Request::Auth {
                share: share.to_string(),
                proof,
            },
        )?;
        self.proving.insert(id, (share.to_string(), secret.clone()));
        Ok(id)
    }

    /// Checks the answer to an `Auth` request: a server proof must match the secret.
    fn check_server_proof(&mut self, id: u64, body: &Response) -> Result<(), ProtoError> {
        let (Some((share, secret)), State::Ready(..)) = (self.proving.remove(&id), &self.state)
        else {
            return Ok(());
        };
        match body {
            Response::Authenticated { proof: Some(p) }
                if !secret.check_server_proof(&share, &self.nonce, &self.proof_nonce, p) =>
            {
                Err(ProtoError::ServerNotAuthentic(share))
            }
            _ => Ok(()),
        }
    }

    /// Requests of the application outstanding (the probe left out).
    fn waiting(&self) -> usize {
        self.outstanding.len() - usize::from(self.probe.is_some())
    }

    /// The most requests the server takes at once (one before the welcome).
    fn inflight_limit(&self) -> usize {
        match &self.state {
            State::Ready(w, _) => w.max_inflight_requests.max(1) as usize,
            _ => 1,
        }
    }

    fn flush_queue(&mut self, now: Instant) {
        if !matches!(self.state, State::Ready(..)) {
            return;
        }
        let was_waiting = self.waiting() > 0;
        let limit = self.inflight_limit();
        while self.outstanding.len() < limit {
            let Some((id, body)) = self.queued.pop_front() else {
                break;
            };
            self.outstanding.insert(id);
            self.transmit.push_back(Message::Request { id, body });
        }
        // The silence clock starts when the first request goes out after none waited;
        // while some wait, only a message from the server restarts it.
        if !was_waiting && self.waiting() > 0 {
            self.arm_liveness(now);
        }
    }

    /// Restarts the liveness clock at `now`.
    fn arm_liveness(&mut self, now: Instant) {
        self.silent_since = Some(now);
        self.timers
            .set(Timer::Probe, now + self.liveness.probe_after);
        self.timers
            .set(Timer::Silence, now + self.liveness.silence_limit);
    }

    /// The server was heard at `now`: restart the liveness clock, or stop it when
    /// nothing waits.
    fn heard(&mut self, now: Instant) {
        if self.waiting() > 0 {
            self.arm_liveness(now);
        } else {
            self.silent_since = None;
            self.timers.stop(Timer::Probe);
            self.timers.stop(Timer::Silence);
        }
    }

    /// Sends a liveness probe unless one is outstanding or the server's in-flight
    /// limit is reached (then the silence limit alone decides); probes again after
    /// [`Liveness::probe_after`] either way.
    fn send_probe(&mut self, now: Instant) {
        if !matches!(self.state, State::Ready(..)) {
            return;
        }
        self.timers
            .set(Timer::Probe, now + self.liveness.probe_after);
        if self.probe.is_some() || self.outstanding.len() >= self.inflight_limit() {
            return;
        }
        let id = self.next_id;
        self.next_id += 1;
        self.outstanding.insert(id);
        self.probe = Some(id);
        self.transmit.push_back(Message::Request {
            id,
            body: Request::Counters,
        });
    }

    /// Feeds one received message in. An error closes the session (and is also
    /// reported as [`ClientEvent::Closed`]).
    pub fn handle_message(&mut self, now: Instant, msg: Message) -> Result<(), ProtoError> {
        let result = self.on_message(now, msg);
        if let Err(e) = &result {
            self.close(e.clone());
        }
        result
    }

    fn on_message(&mut self, now: Instant, msg: Message) -> Result<(), ProtoError> {
        match (&self.state, msg) {
            (State::AwaitWelcome, Message::Welcome(w)) => {
                if w.version != PROTOCOL_VERSION {
                    return Err(ProtoError::Incompatible(format!(
                        "server chose version {}, this client speaks {PROTOCOL_VERSION}",
                        w.version
                    )));
                }
                let negotiated =
                    caps::accept(&w.capabilities, &self.offer).map_err(ProtoError::Incompatible)?;
                let transcript = handshake_transcript(&self.hello, &w)?;
                self.transcript = Some(transcript);
                self.proof_nonce = match negotiated.encryption {
                    Some(_) => crate::auth::bind_to_transcript(&w.nonce, &transcript),
                    None => w.nonce,
                };
                self.timers.stop(Timer::Handshake);
                self.events.push_back(ClientEvent::Connected(w.clone()));
                self.state = State::Ready(w, negotiated);
                self.flush_queue(now);
                Ok(())
            }
            (State::AwaitWelcome, Message::Refused(e)) => Err(ProtoError::Refused(e)),
            (State::Ready(..), Message::Response { id, body }) => {
                if !self.outstanding.remove(&id) {
                    return Err(ProtoError::UnknownRequest(id));
                }
                if self.probe == Some(id) {
                    // Any answer, a refusal included, proves the server runs.
                    self.probe = None;
                } else {
                    self.check_server_proof(id, &body)?;
                    self.events.push_back(ClientEvent::Response { id, body });
                }
                self.heard(now);
                self.flush_queue(now);
                Ok(())
            }
            (State::Closed, _) => Ok(()),
            (state, msg) => Err(ProtoError::Unexpected {
                got: message_name(&msg),
                state: match state {
                    State::AwaitWelcome => "awaiting the server's welcome",
                    _ => "in session",
                },
            }),
        }
    }

    /// Fires expired timers.
    pub fn handle_timeout(&mut self, now: Instant) {
        while let Some(timer) = self.timers.take_expired(now) {
            match timer {
                Timer::Handshake => self.close(ProtoError::HandshakeTimeout),
                Timer::Silence => self.close(ProtoError::ServerSilent(self.liveness.silence_limit)),
                Timer::Probe => self.send_probe(now),
            }
        }
    }

    fn close(&mut self, reason: ProtoError) {
        if matches!(self.state, State::Closed) {
            return;
        }
        self.state = State::Closed;
        self.closed_by = Some(reason.clone());
        self.timers = TimerTable::default();
        self.outstanding.clear();
        self.queued.clear();
        self.proving.clear();
        self.probe = None;
        self.silent_since = None;
        self.events.push_back(ClientEvent::Closed(reason));
    }

    /// Next message to send.
    pub fn poll_transmit(&mut self) -> Option<Message> {
        self.transmit.pop_front()
    }

    /// Next event to act on.
    pub fn poll_event(&mut self) -> Option<ClientEvent> {
        self.events.pop_front()
    }

    /// When [`ClientSession::handle_timeout`] must next be called.
    pub fn poll_timeout(&self) -> Option<Instant> {
        self.timers.next()
    }

    /// The server's welcome, once connected.
    pub fn welcome(&self) -> Option<&Welcome> {
        match &self.state {
            State::Ready(w, _) => Some(w),
            _ => None,
        }
    }

    /// The handshake's transcript ([`crate::seal::transcript`]), once connected: what
    /// an encrypted session's keys and proofs are bound to.
    pub fn transcript(&self) -> Option<[u8; 32]> {
        self.transcript
    }

    /// What the handshake agreed on, once connected.
    pub fn negotiated(&self) -> Option<Negotiated> {
        match &self.state {
            State::Ready(_, n) => Some(*n),
            _ => None,
        }
    }

    /// True once the session has ended.
    pub fn is_closed(&self) -> bool {
        matches!(self.state, State::Closed)
    }

    /// Why the session ended, once it has.
    pub fn close_reason(&self) -> Option<&ProtoError> {
        self.closed_by.as_ref()
    }

    /// Requests sent and not yet answered (a liveness probe left out).
    pub fn outstanding(&self) -> usize {
        self.waiting()
    }
}

/// Short name of a message's variant, for errors.
pub fn message_name(msg: &Message) -> &'static str {
    match msg {
        Message::Hello(_) => "Hello",
        Message::Welcome(_) => "Welcome",
        Message::Refused(_) => "Refused",
        Message::Request { .. } => "Request",
        Message::Response { .. } => "Response",
    }
}

/// The transcript of a handshake: its hello and welcome, as encoded.
pub(crate) fn handshake_transcript(
    hello: &Hello,
    welcome: &Welcome,
) -> Result<[u8; 32], ProtoError> {
    let hello = crate::codec::encode(&Message::Hello(hello.clone()))?;
    let welcome = crate::codec::encode(&Message::Welcome(welcome.clone()))?;
    Ok(crate::seal::transcript(&hello, &welcome))
}
