//! The server half of a session.
//!
//! Call order: the driver feeds each received message to
//! [`ServerSession::handle_message`], sends everything from
//! [`ServerSession::poll_transmit`], calls [`ServerSession::handle_timeout`] when
//! [`ServerSession::poll_timeout`] passes, and acts on [`ServerSession::poll_event`]:
//! each [`ServerEvent::Request`] must be answered exactly once with
//! [`ServerSession::respond`]. After [`ServerEvent::Closed`] the driver sends what is
//! left to transmit and closes the connection.

use std::collections::{HashSet, VecDeque};
use std::time::Instant;

use super::client::message_name;
use super::timer::{Timer, TimerTable};
use super::{ProtoError, HANDSHAKE_TIMEOUT, MAX_INFLIGHT_REQUESTS};
use crate::msg::{
    ErrorKind, Message, RemoteError, Request, Response, Welcome, HELLO_MAGIC, MAX_WINDOW_CHUNKS,
    PROTOCOL_VERSION,
};

/// What the server announces in its welcome.
#[derive(Debug, Clone)]
pub struct ServerParams {
    /// Software name and version.
    pub software: String,
    /// Chunk size for transfers.
    pub chunk_bytes: u32,
}

/// What the driver must act on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ServerEvent {
    /// The handshake finished; the client named its software.
    Ready {
        /// The client's software string.
        software: String,
    },
    /// A request to perform and then answer with [`ServerSession::respond`].
    Request {
        /// The request's id.
        id: u64,
        /// The request.
        body: Request,
    },
    /// The session is over.
    Closed(ProtoError),
}

#[derive(Debug, PartialEq, Eq)]
enum State {
    AwaitHello,
    Ready,
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
}

impl ServerSession {
    /// A session for a connection accepted at `now`.
    pub fn new(now: Instant, params: ServerParams) -> ServerSession {
        let mut timers = TimerTable::default();
        timers.set(Timer::Handshake, now + HANDSHAKE_TIMEOUT);
        ServerSession {
            params,
            state: State::AwaitHello,
            transmit: VecDeque::new(),
            events: VecDeque::new(),
            outstanding: HashSet::new(),
            timers,
        }
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
            (State::AwaitHello, Message::Hello(h)) => {
                let problem = if h.magic != HELLO_MAGIC {
                    Some("not a Ferry client (bad magic)".to_string())
                } else if !(h.min_version..=h.max_version).contains(&PROTOCOL_VERSION) {
                    Some(format!(
                        "client speaks versions {}..={}, server speaks {PROTOCOL_VERSION}",
                        h.min_version, h.max_version
                    ))
                } else {
                    None
                };
                if let Some(message) = problem {
                    self.transmit.push_back(Message::Refused(RemoteError {
                        kind: ErrorKind::Protocol,
                        message: message.clone(),
                    }));
                    return Err(ProtoError::Incompatible(message));
                }
                self.timers.stop(Timer::Handshake);
                self.state = State::Ready;
                self.transmit.push_back(Message::Welcome(Welcome {
                    version: PROTOCOL_VERSION,
                    software: self.params.software.clone(),
                    chunk_bytes: self.params.chunk_bytes,
                    max_window_chunks: MAX_WINDOW_CHUNKS as u32,
                    max_inflight_requests: MAX_INFLIGHT_REQUESTS,
                }));
                self.events.push_back(ServerEvent::Ready {
                    software: h.software,
                });
                Ok(())
            }
            (State::Ready, Message::Request { id, body }) => {
                if self.outstanding.contains(&id) {
                    return Err(ProtoError::DuplicateRequest(id));
                }
                if self.outstanding.len() >= MAX_INFLIGHT_REQUESTS as usize {
                    return Err(ProtoError::TooManyRequests(MAX_INFLIGHT_REQUESTS));
                }
                self.outstanding.insert(id);
                self.events.push_back(ServerEvent::Request { id, body });
                Ok(())
            }
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

    /// Answers request `id`. Answers to requests that are not outstanding (the session
    /// closed meanwhile) are dropped.
    pub fn respond(&mut self, id: u64, body: Response) {
        if self.state == State::Ready && self.outstanding.remove(&id) {
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
}
