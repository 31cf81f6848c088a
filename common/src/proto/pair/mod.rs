//! Both ends of a session in memory, with a simulated clock: every message goes
//! through the real codec, and `drive` runs until both sides are idle.
//!
//! - [`Pair`] holds the two sessions and the wire between them, with a hook that can
//!   tamper with messages to the client (counted in `Pair::tampered`).
//! - `sim` plays the server's driver over an in-memory share and the client's
//!   registered memory, with one-sided READs and WRITEs that can damage bytes on the
//!   wire (each damage counted), so whole transfers, batches and maps run through
//!   both cores.
//! - `session`, `transfers` and `tables` are the tests: the handshake and
//!   authentication; uploads, downloads, resume, manifests and retries under faults;
//!   and every refusal of the connection's tables.

use std::cell::RefCell;
use std::collections::VecDeque;
use std::rc::Rc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::client::{ClientEvent, ClientSession};
use super::conn::Grant;
use super::server::{AccessTable, ServerEvent, ServerParams, ServerSession};
use super::ProtoError;
use crate::auth::ShareAccess;
use crate::codec::{decode, encode};
use crate::msg::*;

mod session;
mod sim;

use sim::Sim;
mod tables;
mod transfers;

/// Answers each admitted request; `None` leaves it outstanding.
type Responder = Box<dyn FnMut(&Request, Grant) -> Option<Response>>;

/// Changes a message on its way to the client; returns whether it did.
type Tamper = Box<dyn FnMut(&mut Message) -> bool>;

/// Chunk size of the pairs' servers: small, so files of a few KiB span many chunks.
const CHUNK: u32 = 4096;

struct Pair {
    now: Instant,
    client: ClientSession,
    server: ServerSession,
    to_server: VecDeque<Vec<u8>>,
    to_client: VecDeque<Vec<u8>>,
    client_events: Vec<ClientEvent>,
    server_events: Vec<ServerEvent>,
    responder: Responder,
    tamper: Option<Tamper>,
    /// Messages the tamper hook changed.
    tampered: usize,
    max_server_outstanding: usize,
    server_outstanding: usize,
}

impl Pair {
    /// A pair whose server serves share "s" without a secret.
    fn new() -> Pair {
        Pair::with_access(AccessTable::from([("s".to_string(), ShareAccess::Open)]))
    }

    fn with_access(access: AccessTable) -> Pair {
        Pair::with(access, DEFAULT_CHUNK_BYTES)
    }

    fn with(access: AccessTable, chunk_bytes: u32) -> Pair {
        // The only clock read in the module: a base instant that is then advanced
        // by hand, so runs are deterministic.
        let now = Instant::now();
        Pair {
            now,
            client: ClientSession::new(now, "test-client", [1; 32]),
            server: ServerSession::new(
                now,
                ServerParams {
                    software: "test-server".into(),
                    chunk_bytes,
                    access: Arc::new(access),
                    policies: Arc::default(),
                    cluster: false,
                },
                [2; 32],
            ),
            to_server: VecDeque::new(),
            to_client: VecDeque::new(),
            client_events: Vec::new(),
            server_events: Vec::new(),
            responder: Box::new(|_, _| Some(Response::Ok)),
            tamper: None,
            tampered: 0,
            max_server_outstanding: 0,
            server_outstanding: 0,
        }
    }

    /// A pair over a simulated share "s" with chunks of [`CHUNK`] bytes, connected.
    fn served() -> (Pair, Rc<RefCell<Sim>>) {
        let mut p = Pair::with(
            AccessTable::from([("s".to_string(), ShareAccess::Open)]),
            CHUNK,
        );
        let sim = Sim::new(CHUNK);
        Sim::serve(&sim, &mut p);
        p.drive();
        (p, sim)
    }

    fn drive(&mut self) {
        loop {
            let mut progressed = false;
            while let Some(m) = self.client.poll_transmit() {
                self.to_server.push_back(encode(&m).unwrap());
                progressed = true;
            }
            while let Some(mut m) = self.server.poll_transmit() {
                if let Some(tamper) = &mut self.tamper {
                    if tamper(&mut m) {
                        self.tampered += 1;
                    }
                }
                self.to_client.push_back(encode(&m).unwrap());
                progressed = true;
            }
            if let Some(bytes) = self.to_server.pop_front() {
                match decode(&bytes) {
                    Ok(msg) => {
                        let _ = self.server.handle_message(self.now, msg);
                    }
                    Err(e) => self.server.handle_undecodable(self.now, &bytes, e),
                }
                progressed = true;
            }
            if let Some(bytes) = self.to_client.pop_front() {
                let _ = self
                    .client
                    .handle_message(self.now, decode(&bytes).unwrap());
                progressed = true;
            }
            while let Some(e) = self.server.poll_event() {
                if let ServerEvent::Request { id, body, grant } = &e {
                    self.server_outstanding += 1;
                    self.max_server_outstanding =
                        self.max_server_outstanding.max(self.server_outstanding);
                    if let Some(resp) = (self.responder)(body, *grant) {
                        self.server_outstanding -= 1;
                        self.server.respond(*id, resp);
                    }
                }
                self.server_events.push(e);
                progressed = true;
            }
            while let Some(e) = self.client.poll_event() {
                self.client_events.push(e);
                progressed = true;
            }
            if !progressed {
                return;
            }
        }
    }

    fn advance(&mut self, d: Duration) {
        self.now += d;
        if self.client.poll_timeout().is_some_and(|t| t <= self.now) {
            self.client.handle_timeout(self.now);
        }
        if self.server.poll_timeout().is_some_and(|t| t <= self.now) {
            self.server.handle_timeout(self.now);
        }
        self.drive();
    }

    fn responses(&self) -> Vec<(u64, Response)> {
        self.client_events
            .iter()
            .filter_map(|e| match e {
                ClientEvent::Response { id, body } => Some((*id, body.clone())),
                _ => None,
            })
            .collect()
    }

    /// The answer to request `id`, once it came.
    fn response(&self, id: u64) -> Option<Response> {
        self.client_events.iter().find_map(|e| match e {
            ClientEvent::Response { id: i, body } if *i == id => Some(body.clone()),
            _ => None,
        })
    }

    /// Sends `body`, drives both sides, and returns its answer.
    fn call(&mut self, body: Request) -> Response {
        let id = self.client.request(self.now, body).unwrap();
        self.drive();
        self.response(id).expect("request answered")
    }

    fn client_closed(&self) -> Option<&ProtoError> {
        self.client_events.iter().find_map(|e| match e {
            ClientEvent::Closed(r) => Some(r),
            _ => None,
        })
    }

    fn server_closed(&self) -> Option<&ProtoError> {
        self.server_events.iter().find_map(|e| match e {
            ServerEvent::Closed(r) => Some(r),
            _ => None,
        })
    }

    /// How many admitted requests reached the server's driver.
    fn reached_driver(&self) -> usize {
        self.server_events
            .iter()
            .filter(|e| matches!(e, ServerEvent::Request { .. }))
            .count()
    }
}

fn error_kind(r: &Response) -> Option<ErrorKind> {
    match r {
        Response::Error(e) => Some(e.kind),
        _ => None,
    }
}

fn stat(path: &str) -> Request {
    Request::Stat {
        share: "s".into(),
        path: path.into(),
        follow: false,
    }
}
