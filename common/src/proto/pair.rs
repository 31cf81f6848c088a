//! Both ends of a session in memory, with a simulated clock: every message goes
//! through the real codec, and `drive` runs until both sides are idle.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::client::{ClientEvent, ClientSession};
use super::server::{AccessTable, ServerEvent, ServerParams, ServerSession};
use super::transfer::{UploadState, WindowPlan};
use super::{ProtoError, MAX_INFLIGHT_REQUESTS};
use crate::auth::{Secret, ShareAccess};
use crate::chunk::{hash_chunk, hash_chunks, manifest_id};
use crate::codec::{decode, encode};
use crate::msg::*;

/// Answers each request; `None` leaves it outstanding.
type Responder = Box<dyn FnMut(&Request) -> Option<Response>>;

struct Pair {
    now: Instant,
    client: ClientSession,
    server: ServerSession,
    to_server: VecDeque<Vec<u8>>,
    to_client: VecDeque<Vec<u8>>,
    client_events: Vec<ClientEvent>,
    server_events: Vec<ServerEvent>,
    responder: Responder,
    max_server_outstanding: usize,
    server_outstanding: usize,
}

impl Pair {
    /// A pair whose server serves share "s" without a secret.
    fn new() -> Pair {
        Pair::with_access(AccessTable::from([("s".to_string(), ShareAccess::Open)]))
    }

    fn with_access(access: AccessTable) -> Pair {
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
                    chunk_bytes: DEFAULT_CHUNK_BYTES,
                    access: Arc::new(access),
                },
                [2; 32],
            ),
            to_server: VecDeque::new(),
            to_client: VecDeque::new(),
            client_events: Vec::new(),
            server_events: Vec::new(),
            responder: Box::new(|_| Some(Response::Ok)),
            max_server_outstanding: 0,
            server_outstanding: 0,
        }
    }

    fn drive(&mut self) {
        loop {
            let mut progressed = false;
            while let Some(m) = self.client.poll_transmit() {
                self.to_server.push_back(encode(&m).unwrap());
                progressed = true;
            }
            while let Some(m) = self.server.poll_transmit() {
                self.to_client.push_back(encode(&m).unwrap());
                progressed = true;
            }
            if let Some(bytes) = self.to_server.pop_front() {
                let _ = self
                    .server
                    .handle_message(self.now, decode(&bytes).unwrap());
                progressed = true;
            }
            if let Some(bytes) = self.to_client.pop_front() {
                let _ = self
                    .client
                    .handle_message(self.now, decode(&bytes).unwrap());
                progressed = true;
            }
            while let Some(e) = self.server.poll_event() {
                if let ServerEvent::Request { id, body, .. } = &e {
                    self.server_outstanding += 1;
                    self.max_server_outstanding =
                        self.max_server_outstanding.max(self.server_outstanding);
                    if let Some(resp) = (self.responder)(body) {
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
}

fn stat(path: &str) -> Request {
    Request::Stat {
        share: "s".into(),
        path: path.into(),
        follow: false,
    }
}

#[test]
fn handshake_then_requests_in_order() {
    let mut p = Pair::new();
    // Made before the welcome: must wait inside the session.
    let a = p.client.request(stat("a")).unwrap();
    let b = p.client.request(stat("b")).unwrap();
    p.drive();
    assert!(matches!(p.client_events[0], ClientEvent::Connected(_)));
    assert_eq!(p.client.welcome().unwrap().chunk_bytes, DEFAULT_CHUNK_BYTES);
    assert_eq!(p.responses(), vec![(a, Response::Ok), (b, Response::Ok)]);
    assert!(p.client_closed().is_none() && p.server_closed().is_none());
}

#[test]
fn in_flight_requests_are_bounded_by_the_welcome() {
    let mut p = Pair::new();
    p.drive();
    // The server holds every request; the client must stop at the limit.
    p.responder = Box::new(|_| None);
    for i in 0..1000 {
        p.client.request(stat(&i.to_string())).unwrap();
    }
    p.drive();
    assert_eq!(p.client.outstanding(), MAX_INFLIGHT_REQUESTS as usize);
    assert_eq!(p.max_server_outstanding, MAX_INFLIGHT_REQUESTS as usize);
    assert!(p.server_closed().is_none());
}

#[test]
fn all_of_many_requests_are_answered() {
    let mut p = Pair::new();
    let ids: Vec<u64> = (0..1000)
        .map(|i| p.client.request(stat(&i.to_string())).unwrap())
        .collect();
    p.drive();
    let got: Vec<u64> = p.responses().into_iter().map(|(id, _)| id).collect();
    assert_eq!(got, ids);
}

#[test]
fn bad_magic_is_refused() {
    let mut p = Pair::new();
    let mut hello = match p.client.poll_transmit().unwrap() {
        Message::Hello(h) => h,
        other => panic!("first message was {other:?}"),
    };
    hello.magic = *b"HTTP";
    p.to_server
        .push_back(encode(&Message::Hello(hello)).unwrap());
    p.drive();
    assert!(matches!(
        p.server_closed(),
        Some(ProtoError::Incompatible(_))
    ));
    assert!(matches!(p.client_closed(), Some(ProtoError::Refused(_))));
}

#[test]
fn version_mismatch_is_refused() {
    let mut p = Pair::new();
    p.client.poll_transmit();
    let hello = Hello {
        magic: HELLO_MAGIC,
        min_version: PROTOCOL_VERSION + 1,
        max_version: PROTOCOL_VERSION + 3,
        software: "future".into(),
        nonce: [0; 32],
        capabilities: vec![],
    };
    p.to_server
        .push_back(encode(&Message::Hello(hello)).unwrap());
    p.drive();
    assert!(matches!(
        p.server_closed(),
        Some(ProtoError::Incompatible(_))
    ));
}

#[test]
fn request_before_hello_closes_the_server_session() {
    let mut p = Pair::new();
    p.client.poll_transmit(); // drop the Hello
    let msg = Message::Request {
        id: 1,
        body: stat("x"),
    };
    assert!(matches!(
        p.server.handle_message(p.now, msg),
        Err(ProtoError::Unexpected { .. })
    ));
    assert!(p.server.is_closed());
}

#[test]
fn duplicate_request_id_closes_the_server_session() {
    let mut p = Pair::new();
    p.drive();
    p.responder = Box::new(|_| None);
    let msg = Message::Request {
        id: 5,
        body: stat("x"),
    };
    p.server.handle_message(p.now, msg.clone()).unwrap();
    assert_eq!(
        p.server.handle_message(p.now, msg),
        Err(ProtoError::DuplicateRequest(5))
    );
}

#[test]
fn response_to_unknown_request_closes_the_client_session() {
    let mut p = Pair::new();
    p.drive();
    let bogus = Message::Response {
        id: 99,
        body: Response::Ok,
    };
    assert_eq!(
        p.client.handle_message(p.now, bogus),
        Err(ProtoError::UnknownRequest(99))
    );
    assert!(p.client.request(stat("x")).is_err());
}

#[test]
fn silent_server_times_the_handshake_out() {
    let mut p = Pair::new();
    p.client.poll_transmit(); // the server never sees the Hello
    p.advance(Duration::from_secs(9));
    assert!(p.client_closed().is_none());
    p.advance(Duration::from_secs(2));
    assert_eq!(p.client_closed(), Some(&ProtoError::HandshakeTimeout));
    assert_eq!(p.server_closed(), Some(&ProtoError::HandshakeTimeout));
}

/// A whole upload through both state machines: the client plans windows and hashes
/// them, the "RDMA READ" copies from the client's bytes (optionally flipping a bit on
/// the wire), the server verifies each chunk and decides whether it may commit.
fn upload(data: &[u8], chunk: u32, flip_at: Option<usize>) -> Result<(), ProtoError> {
    let mut plan = WindowPlan::new(data.len() as u64, chunk, 3, 2);
    let mut server = UploadState::new(data.len() as u64, chunk, 3);
    while !plan.is_complete() {
        let mut started = Vec::new();
        while let Some(w) = plan.poll_window() {
            let bytes = &data[w.offset as usize..(w.offset + w.len) as usize];
            let hashes = hash_chunks(bytes, chunk as usize);
            let sw = server.handle_window(w.offset, w.len, &hashes)?;
            started.push((w, sw, hashes));
        }
        // Complete in reverse order: windows may finish out of order.
        for (w, sw, hashes) in started.into_iter().rev() {
            for (c, expect) in sw.chunks(chunk).zip(&hashes) {
                let start = (sw.offset + c.window_offset) as usize;
                let mut pulled = data[start..start + c.len as usize].to_vec();
                if let Some(at) = flip_at {
                    if (start..start + pulled.len()).contains(&at) {
                        pulled[at - start] ^= 0x10;
                    }
                }
                let got = hash_chunk(&pulled);
                if got != *expect {
                    server.handle_window_failed(sw);
                    return Err(ProtoError::Transfer(format!("chunk {} mismatch", c.index)));
                }
                server.handle_chunk_verified(c.index, got)?;
            }
            plan.handle_window_done(w)?;
        }
    }
    let hashes = hash_chunks(data, chunk as usize);
    let manifest = manifest_id(data.len() as u64, chunk, &hashes);
    assert_eq!(server.commit(&manifest)?, hashes);
    Ok(())
}

#[test]
fn clean_upload_commits() {
    let data: Vec<u8> = (0..50_000u32).map(|i| (i * 13 % 251) as u8).collect();
    upload(&data, 4096, None).unwrap();
    upload(&data[..4096], 4096, None).unwrap();
    upload(&[], 4096, None).unwrap();
}

#[test]
fn flipped_bit_is_detected_and_blocks_commit() {
    let data: Vec<u8> = (0..50_000u32).map(|i| (i * 13 % 251) as u8).collect();
    for at in [0, 4095, 4096, 30_000, 49_999] {
        assert!(upload(&data, 4096, Some(at)).is_err(), "flip at {at}");
    }
}

fn secret(text: &str) -> Secret {
    Secret::from_bytes(text.as_bytes(), "test").unwrap()
}

/// A pair whose server guards "s" with a secret and also has an open share "pub".
fn guarded() -> Pair {
    Pair::with_access(AccessTable::from([
        (
            "s".to_string(),
            ShareAccess::Secret(secret("the-right-secret-0001")),
        ),
        ("pub".to_string(), ShareAccess::Open),
    ]))
}

fn auth_with(p: &mut Pair, share: &str, key: &Secret) -> u64 {
    p.drive();
    let (c, s) = (*p.client.nonce(), p.client.welcome().unwrap().nonce);
    let proof = key.client_proof(share, &c, &s);
    let id = p
        .client
        .request(Request::Auth {
            share: share.into(),
            proof,
        })
        .unwrap();
    p.drive();
    id
}

fn error_kind(r: &Response) -> Option<ErrorKind> {
    match r {
        Response::Error(e) => Some(e.kind),
        _ => None,
    }
}

#[test]
fn requests_wait_for_the_proof_of_their_share() {
    let mut p = guarded();
    p.responder = Box::new(|_| Some(Response::Ok));
    let early = p.client.request(stat("a")).unwrap();
    let stats = p.client.request(Request::Stats).unwrap();
    let open = p
        .client
        .request(Request::Stat {
            share: "pub".into(),
            path: "".into(),
            follow: false,
        })
        .unwrap();
    p.drive();
    let r = p.responses();
    assert_eq!(error_kind(&r[0].1), Some(ErrorKind::AuthRequired), "{r:?}");
    // Stats is allowed: the server has an open share.
    assert_eq!(r[1], (stats, Response::Ok));
    assert_eq!(r[2], (open, Response::Ok));
    assert_eq!(r[0].0, early);
    // The refused request never reached the driver, and the refusal was reported.
    let reached: Vec<_> = p
        .server_events
        .iter()
        .filter(|e| matches!(e, ServerEvent::Request { .. }))
        .collect();
    assert_eq!(reached.len(), 2);
    assert!(p
        .server_events
        .iter()
        .any(|e| matches!(e, ServerEvent::Denied { share, .. } if share == "s")));

    let key = secret("the-right-secret-0001");
    let id = auth_with(&mut p, "s", &key);
    let (_, answer) = p.responses().into_iter().find(|(i, _)| *i == id).unwrap();
    let Response::Authenticated { proof: Some(proof) } = answer else {
        panic!("{answer:?}");
    };
    assert!(key.check_server_proof("s", &[1; 32], &[2; 32], &proof));
    let later = p.client.request(stat("a")).unwrap();
    p.drive();
    assert!(p.responses().contains(&(later, Response::Ok)));
    assert!(p.server_closed().is_none());
}

#[test]
fn a_wrong_secret_is_refused_and_closes_the_session() {
    let mut p = guarded();
    let id = auth_with(&mut p, "s", &secret("not-the-right-secret"));
    let r = p.responses();
    assert_eq!(r.len(), 1);
    assert_eq!(r[0].0, id);
    assert_eq!(error_kind(&r[0].1), Some(ErrorKind::AuthFailed));
    assert!(matches!(p.server_closed(), Some(ProtoError::AuthFailed(_))));
    assert!(p
        .server_events
        .iter()
        .any(|e| matches!(e, ServerEvent::Denied { share, .. } if share == "s")));
    // Nothing more is served.
    let _ = p.client.request(stat("a"));
    p.drive();
    assert_eq!(p.responses().len(), 1);
}

#[test]
fn a_proof_is_bound_to_its_share_and_session() {
    // A proof made for another share, or with another server nonce, fails.
    let key = secret("the-right-secret-0001");
    let mut p = Pair::with_access(AccessTable::from([
        ("s".to_string(), ShareAccess::Secret(key.clone())),
        ("t".to_string(), ShareAccess::Secret(key.clone())),
    ]));
    p.drive();
    let proof = key.client_proof("t", &[1; 32], &[2; 32]);
    p.client
        .request(Request::Auth {
            share: "s".into(),
            proof,
        })
        .unwrap();
    p.drive();
    assert!(matches!(p.server_closed(), Some(ProtoError::AuthFailed(_))));

    let mut p = Pair::with_access(AccessTable::from([(
        "s".to_string(),
        ShareAccess::Secret(key.clone()),
    )]));
    p.drive();
    let replayed = key.client_proof("s", &[1; 32], &[9; 32]);
    p.client
        .request(Request::Auth {
            share: "s".into(),
            proof: replayed,
        })
        .unwrap();
    p.drive();
    assert!(matches!(p.server_closed(), Some(ProtoError::AuthFailed(_))));
}

#[test]
fn stats_and_unknown_shares_without_any_proof() {
    let key = secret("the-right-secret-0001");
    let mut p = Pair::with_access(AccessTable::from([(
        "s".to_string(),
        ShareAccess::Secret(key.clone()),
    )]));
    let stats = p.client.request(Request::Stats).unwrap();
    p.drive();
    assert_eq!(
        error_kind(&p.responses()[0].1),
        Some(ErrorKind::AuthRequired)
    );
    let id = auth_with(&mut p, "nope", &key);
    let r = p.responses();
    assert_eq!(r.last().unwrap().0, id);
    assert_eq!(
        error_kind(&r.last().unwrap().1),
        Some(ErrorKind::NoSuchShare)
    );
    auth_with(&mut p, "s", &key);
    let again = p.client.request(Request::Stats).unwrap();
    p.drive();
    assert!(p.responses().contains(&(again, Response::Ok)));
    assert_ne!(stats, again);
}
