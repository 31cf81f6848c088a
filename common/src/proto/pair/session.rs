//! The handshake, capabilities, request bookkeeping and authentication.

use std::time::Duration;

use super::{error_kind, stat, Pair};
use crate::auth::{Secret, ShareAccess};
use crate::codec::encode;
use crate::msg::*;
use crate::proto::caps::{self, HashAlgorithm};
use crate::proto::client::ClientEvent;
use crate::proto::server::{AccessTable, ServerEvent};
use crate::proto::{ProtoError, MAX_INFLIGHT_REQUESTS};

#[test]
fn handshake_then_requests_in_order() {
    let mut p = Pair::new();
    // Made before the welcome: must wait inside the session.
    let a = p.client.request(p.now, stat("a")).unwrap();
    let b = p.client.request(p.now, stat("b")).unwrap();
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
    p.responder = Box::new(|_, _| None);
    for i in 0..1000 {
        p.client.request(p.now, stat(&i.to_string())).unwrap();
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
        .map(|i| p.client.request(p.now, stat(&i.to_string())).unwrap())
        .collect();
    p.drive();
    let got: Vec<u64> = p.responses().into_iter().map(|(id, _)| id).collect();
    assert_eq!(got, ids);
}

#[test]
fn bad_magic_is_refused() {
    let mut p = Pair::new();
    let mut hello = take_hello(&mut p);
    hello.magic = *b"HTTP";
    send_hello(&mut p, hello);
    assert!(matches!(p.client_closed(), Some(ProtoError::Refused(_))));
}

/// The client's hello, taken off the wire before the server sees it.
fn take_hello(p: &mut Pair) -> Hello {
    match p.client.poll_transmit() {
        Some(Message::Hello(h)) => h,
        other => panic!("first message was {other:?}"),
    }
}

/// Sends `hello` in the client's place and expects the server to refuse it.
fn send_hello(p: &mut Pair, hello: Hello) {
    p.to_server
        .push_back(encode(&Message::Hello(hello)).unwrap());
    p.drive();
    assert!(matches!(
        p.server_closed(),
        Some(ProtoError::Incompatible(_))
    ));
}

#[test]
fn version_mismatch_is_refused() {
    let mut p = Pair::new();
    let hello = Hello {
        min_version: PROTOCOL_VERSION + 1,
        max_version: PROTOCOL_VERSION + 3,
        ..take_hello(&mut p)
    };
    send_hello(&mut p, hello);
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
    p.responder = Box::new(|_, _| None);
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
    assert!(p.client.request(p.now, stat("x")).is_err());
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
        .request(
            p.now,
            Request::Auth {
                share: share.into(),
                proof,
            },
        )
        .unwrap();
    p.drive();
    id
}

#[test]
fn requests_wait_for_the_proof_of_their_share() {
    let mut p = guarded();
    p.responder = Box::new(|_, _| Some(Response::Ok));
    let early = p.client.request(p.now, stat("a")).unwrap();
    let stats = p.client.request(p.now, Request::Stats).unwrap();
    let open = p
        .client
        .request(
            p.now,
            Request::Stat {
                share: "pub".into(),
                path: "".into(),
                follow: false,
            },
        )
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
    let later = p.client.request(p.now, stat("a")).unwrap();
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
    let _ = p.client.request(p.now, stat("a"));
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
        .request(
            p.now,
            Request::Auth {
                share: "s".into(),
                proof,
            },
        )
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
        .request(
            p.now,
            Request::Auth {
                share: "s".into(),
                proof: replayed,
            },
        )
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
    let stats = p.client.request(p.now, Request::Stats).unwrap();
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
    let again = p.client.request(p.now, Request::Stats).unwrap();
    p.drive();
    assert!(p.responses().contains(&(again, Response::Ok)));
    assert_ne!(stats, again);
}

#[test]
fn the_handshake_negotiates_capabilities_and_ignores_unknown_ones() {
    let mut p = Pair::new();
    let mut hello = take_hello(&mut p);
    assert_eq!(
        caps::find(&hello.capabilities, caps::HASH),
        Some("blake3,sha256")
    );
    hello
        .capabilities
        .insert(0, Capability::new("from-the-future", "x,y"));
    hello.capabilities.push(Capability::new(caps::HASH, "md5"));
    p.to_server
        .push_back(encode(&Message::Hello(hello)).unwrap());
    p.drive();
    let n = p.server.negotiated().unwrap();
    assert_eq!(n.hash, HashAlgorithm::Blake3);
    assert!(n.accepted.contains(HashAlgorithm::Sha256));
    assert_eq!(p.client.negotiated(), Some(n));
    assert!(p.server_closed().is_none() && p.client_closed().is_none());
}

#[test]
fn a_client_without_meta_gets_its_metadata_requests_refused() {
    // A client of before the `meta` capability: its hello offers only `hash`.
    let mut p = Pair::new();
    let mut hello = take_hello(&mut p);
    hello.capabilities.retain(|c| c.name != caps::META);
    p.to_server
        .push_back(encode(&Message::Hello(hello)).unwrap());
    p.drive();
    assert!(!p.server.negotiated().unwrap().meta);
    assert!(!p.client.negotiated().unwrap().meta);
    let set = p
        .client
        .request(
            p.now,
            Request::SetMeta {
                share: "s".into(),
                entries: vec![],
            },
        )
        .unwrap();
    p.drive();
    assert!(p.responses().iter().any(|(id, r)| *id == set
        && matches!(r, Response::Error(e) if e.kind == ErrorKind::Protocol && e.message.contains("'meta'"))));
    assert!(p.server_closed().is_none() && p.client_closed().is_none());
}

#[test]
fn no_hash_in_common_refuses_the_session() {
    let mut p = Pair::new();
    let mut hello = take_hello(&mut p);
    hello.capabilities = vec![Capability::new(caps::HASH, "md5,crc32")];
    send_hello(&mut p, hello);
    assert!(
        matches!(p.server_closed(), Some(ProtoError::Incompatible(m)) if m.contains("no hash algorithm in common"))
    );
    assert!(
        matches!(p.client_closed(), Some(ProtoError::Refused(m)) if m.message.contains("md5,crc32"))
    );
}

#[test]
fn a_welcome_choosing_what_was_not_offered_closes_the_client() {
    let mut p = Pair::new();
    p.tamper = Some(Box::new(|m| match m {
        Message::Welcome(w) => {
            w.capabilities = vec![Capability::new(caps::HASH, "md5")];
            true
        }
        _ => false,
    }));
    p.drive();
    assert_eq!(p.tampered, 1);
    assert!(
        matches!(p.client_closed(), Some(ProtoError::Incompatible(m)) if m.contains("did not offer"))
    );
}

#[test]
fn an_older_clients_hello_is_refused_by_its_versions() {
    // Version 5's hello: magic and versions first, then software and nonce, and no
    // capabilities. It does not decode as this version's message.
    let mut p = Pair::new();
    p.client.poll_transmit();
    let mut old = postcard::to_stdvec(&(0u8, HELLO_MAGIC, 5u16, 5u16)).unwrap();
    old.extend(postcard::to_stdvec(&("rcp/0.1.0", [3u8; 32])).unwrap());
    p.to_server.push_back(old);
    p.drive();
    assert!(
        matches!(p.server_closed(), Some(ProtoError::Incompatible(m)) if m.contains("client speaks versions 5..=5"))
    );
    assert!(matches!(p.client_closed(), Some(ProtoError::Refused(_))));
}

#[test]
fn undecodable_bytes_close_the_session_without_a_refusal() {
    let mut p = Pair::new();
    p.drive();
    p.to_server.push_back(vec![0xee, 0xee, 0xee]);
    p.drive();
    assert!(matches!(p.server_closed(), Some(ProtoError::Codec(_))));
    assert!(p.client_closed().is_none());
}

#[test]
fn the_client_core_proves_a_secret_and_checks_the_servers_proof() {
    let key = secret("the-right-secret-0001");
    let mut p = guarded();
    p.drive();
    let id = p.client.authenticate(p.now, "s", &key).unwrap();
    p.drive();
    assert!(matches!(
        p.response(id),
        Some(Response::Authenticated { proof: Some(_) })
    ));
    assert_eq!(p.call(stat("a")), Response::Ok);
    // The open share answers without a proof.
    let id = p.client.authenticate(p.now, "pub", &key).unwrap();
    p.drive();
    assert_eq!(
        p.response(id),
        Some(Response::Authenticated { proof: None })
    );
    assert!(p.client_closed().is_none());
}

#[test]
fn a_server_that_cannot_prove_the_secret_is_left() {
    let key = secret("the-right-secret-0001");
    let mut p = guarded();
    // An impostor's answer: a proof made without the secret.
    p.tamper = Some(Box::new(|m| match m {
        Message::Response {
            body: Response::Authenticated { proof: Some(p) },
            ..
        } => {
            p[0] ^= 1;
            true
        }
        _ => false,
    }));
    p.drive();
    let id = p.client.authenticate(p.now, "s", &key).unwrap();
    p.drive();
    assert_eq!(p.tampered, 1, "the fault fired once");
    assert_eq!(p.response(id), None);
    assert_eq!(
        p.client_closed(),
        Some(&ProtoError::ServerNotAuthentic("s".into()))
    );
    assert!(p.client.request(p.now, stat("a")).is_err());
}

#[test]
fn authentication_waits_for_the_welcome() {
    let mut p = guarded();
    assert!(p
        .client
        .authenticate(p.now, "s", &secret("the-right-secret-0001"))
        .is_err());
}

/// A guarded pair whose client offers encryption and whose server can encrypt.
fn encrypted() -> Pair {
    let mut p = guarded();
    let offer = caps::Offer {
        encrypt: Some(caps::EncryptOffer {
            suites: vec![crate::seal::Suite::Aes256Gcm],
            key: [5; 32],
            required: false,
        }),
        ..caps::Offer::default()
    };
    p.client =
        crate::proto::client::ClientSession::with_offer(p.now, "test-client", [1; 32], offer);
    p.server.set_key_share([6; 32]);
    p.drive();
    p
}

#[test]
fn an_encrypted_sessions_proofs_are_bound_to_its_transcript() {
    let mut p = encrypted();
    let t = p.client.transcript().unwrap();
    assert_eq!(p.server.transcript(), Some(t));
    let e = p.client.negotiated().unwrap().encryption.unwrap();
    assert_eq!(p.server.negotiated().unwrap().encryption, Some(e));
    assert_eq!((e.client_key, e.server_key), ([5; 32], [6; 32]));
    // The client core binds its proof, the server checks it, and the server's proof
    // checks out on the client.
    let key = secret("the-right-secret-0001");
    let id = p.client.authenticate(p.now, "s", &key).unwrap();
    p.drive();
    let r = p.responses();
    assert!(
        matches!(r[0], (i, Response::Authenticated { proof: Some(_) }) if i == id),
        "{r:?}"
    );
    assert!(p.server_closed().is_none());
}

#[test]
fn a_proof_over_the_bare_nonces_fails_an_encrypted_session() {
    // What a man in the middle could forward from its own session with the client
    // (other key shares, so another transcript): a proof not bound to this one.
    let mut p = encrypted();
    let key = secret("the-right-secret-0001");
    auth_with(&mut p, "s", &key);
    let r = p.responses();
    assert_eq!(error_kind(&r[0].1), Some(ErrorKind::AuthFailed), "{r:?}");
    assert!(matches!(p.server_closed(), Some(ProtoError::AuthFailed(_))));
}

/// Probes the server saw (liveness probes are `Counters` requests).
fn probes_seen(p: &Pair) -> usize {
    p.server_events
        .iter()
        .filter(|e| {
            matches!(
                e,
                ServerEvent::Request {
                    body: Request::Counters,
                    ..
                }
            )
        })
        .count()
}

/// Advances `p` in steps of a quarter second for `d`.
fn advance_by(p: &mut Pair, d: Duration) {
    let step = Duration::from_millis(250);
    let mut gone = Duration::ZERO;
    while gone < d {
        p.advance(step);
        gone += step;
    }
}

#[test]
fn a_server_silent_while_a_request_waits_ends_the_session_at_the_limit() {
    let mut p = Pair::new();
    p.drive();
    // The server takes the request and answers nothing, its probes included.
    p.responder = Box::new(|_, _| None);
    let id = p.client.request(p.now, stat("a")).unwrap();
    p.drive();
    let limit = p.client.liveness().silence_limit;
    advance_by(&mut p, limit - Duration::from_millis(250));
    assert!(p.client_closed().is_none(), "closed before the limit");
    assert_eq!(probes_seen(&p), 1, "one probe outstanding at a time");
    advance_by(&mut p, Duration::from_millis(500));
    assert_eq!(p.client_closed(), Some(&ProtoError::ServerSilent(limit)));
    assert!(p.response(id).is_none());
}

#[test]
fn a_busy_server_that_answers_probes_is_waited_for() {
    let mut p = Pair::new();
    p.drive();
    // The request waits (a long fsync, say); the connection still answers probes.
    p.responder = Box::new(|body, _| matches!(body, Request::Counters).then_some(Response::Ok));
    let id = p.client.request(p.now, stat("a")).unwrap();
    p.drive();
    let limit = p.client.liveness().silence_limit;
    advance_by(&mut p, 3 * limit);
    assert!(p.client_closed().is_none(), "a live server was cut off");
    assert!(probes_seen(&p) >= 3, "probes: {}", probes_seen(&p));
    assert_eq!(p.client.outstanding(), 1);
    assert!(
        p.responses().is_empty(),
        "a probe's answer reached the application"
    );
    // The answer still comes through when it is ready.
    p.server.respond(id, Response::Ok);
    p.drive();
    assert_eq!(p.response(id), Some(Response::Ok));
}

#[test]
fn an_idle_session_is_neither_probed_nor_closed() {
    let mut p = Pair::new();
    assert_eq!(p.call(stat("a")), Response::Ok);
    let limit = p.client.liveness().silence_limit;
    advance_by(&mut p, 3 * limit);
    assert!(p.client_closed().is_none());
    assert_eq!(probes_seen(&p), 0);
    assert_eq!(p.client.poll_timeout(), None);
}
