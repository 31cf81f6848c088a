//! `server_session`: [`Record`]s drive the sans-IO [`ServerSession`] with a simulated
//! clock, and a reference model of the session rules (`docs/protocol.md` section 2)
//! predicts every event and transmitted message exactly.
//!
//! Record flags, low two bits: `0` feed `bytes` as a received message (skipped if it
//! does not decode: the driver closes the connection then); `1` advance the clock by
//! `bytes` (u32 LE) milliseconds, or seconds with flag bit 2, and fire the timer if it
//! is due, or regardless with flag bit 3; `2` answer the outstanding request
//! `bytes[0] % n` with the response in `bytes[1..]` (`Ok` if that does not decode);
//! `3` answer the id in `bytes` (u64 LE), outstanding or not. Flag `0` with bit 2
//! feeds a *valid* `Auth` request instead (a fuzzer cannot forge an HMAC): id from
//! `bytes[..8]` (u64 LE), share name from the rest; the proof is made with
//! [`SECRET`] and the nonces of this session.
//!
//! The session guards share `data` with [`SECRET`] and serves `pub` openly; the model
//! predicts every refusal (`AuthRequired`, `AuthFailed`, `NoSuchShare` for an `Auth`,
//! a hello whose capabilities have no hash in common, and the connection's tables:
//! requests naming a transfer or mapped file that is not open, or not of the right
//! kind, the per-connection limits and malformed upload batches), and which opens the
//! answers make open.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use ferry_common::auth::{Nonce, Secret, ShareAccess};
use ferry_common::codec;
use ferry_common::msg::{
    Capability, ErrorKind, Extent, Hash256, Message, RegionDesc, Request, Response, BATCH_MAX_BYTES, HELLO_MAGIC,
    MAX_FILE_IO_BYTES, MAX_OPEN_FILES, MAX_WINDOW_CHUNKS, MAX_WRITE_EXTENTS, PROTOCOL_VERSION,
    SMALL_FILE_MAX_BYTES,
};
use ferry_common::proto::conn::{MAX_OPEN_MAPS, MAX_OPEN_TRANSFERS};
use ferry_common::proto::server::{AccessTable, ServerEvent, ServerParams, ServerSession};
use ferry_common::proto::{ProtoError, HANDSHAKE_TIMEOUT, MAX_INFLIGHT_REQUESTS};

use crate::{records, Record};

const SOFTWARE: &str = "ferryd/fuzz";
const CHUNK_BYTES: u32 = 1 << 20;
/// The secret of share `data`.
pub const SECRET: &str = "fuzz-secret-of-share-data";
/// The server's nonce (fixed: the run must be deterministic).
const SERVER_NONCE: Nonce = [0x5a; 32];

fn secret() -> Secret {
    Secret::from_bytes(SECRET.as_bytes(), "fuzz").expect("a valid secret")
}

/// Runs the records of `data` against a fresh session and the model.
pub fn server_session(data: &[u8]) {
    let start = Instant::now();
    let access = AccessTable::from([
        ("data".to_string(), ShareAccess::Secret(secret())),
        ("pub".to_string(), ShareAccess::Open),
    ]);
    let mut h = Harness {
        session: ServerSession::new(
            start,
            ServerParams {
                software: SOFTWARE.into(),
                chunk_bytes: CHUNK_BYTES,
                access: Arc::new(access),
                policies: Arc::default(),
                cluster: false,
            },
            SERVER_NONCE,
        ),
        start,
        now: start,
        ready: None,
        meta: false,
        hash: "sha256",
        medium: false,
        write: false,
        dirs: false,
        finish: false,
        closed: false,
        outstanding: Vec::new(),
        authenticated: HashSet::new(),
        denied: HashSet::new(),
        transmits: VecDeque::new(),
        events: VecDeque::new(),
        tables: Tables::default(),
    };
    h.check_drained();
    for r in records(data) {
        match r.flags & 3 {
            0 if r.flags & 4 != 0 => h.receive_valid_auth(r.bytes),
            0 => h.receive(r.bytes),
            1 => h.advance(r),
            2 => h.respond_outstanding(r.bytes),
            _ => h.respond_any(r.bytes),
        }
        h.check_drained();
    }
}

/// The hash algorithm a hello's capabilities leave the session, if any: the first of
/// its first `hash` capability's list that this build knows (`blake3`, `sha256`), or
/// `sha256` when it offers no `hash` at all.
fn chosen_hash(caps: &[Capability]) -> Option<&'static str> {
    match caps.iter().find(|c| c.name == "hash") {
        None => Some("sha256"),
        Some(c) => c.value.split(',').find_map(|h| match h {
            "blake3" => Some("blake3"),
            "sha256" => Some("sha256"),
            _ => None,
        }),
    }
}

/// Whether a hello turns the `meta` capability on: its first `meta` capability lists
/// `1` (the only version of this build); otherwise the metadata requests are refused.
fn offers_meta(caps: &[Capability]) -> bool {
    caps.iter()
        .find(|c| c.name == "meta")
        .is_some_and(|c| c.value.split(',').any(|v| v == "1"))
}

/// Whether a hello turns the `write` capability on: its first `write` capability
/// lists `1`; otherwise the requests of a writable mount are refused.
fn offers_write(caps: &[Capability]) -> bool {
    caps.iter()
        .find(|c| c.name == "write")
        .is_some_and(|c| c.value.split(',').any(|v| v == "1"))
}

/// Whether a hello turns the `dirs` capability on: its first `dirs` capability lists
/// `1`; otherwise the directory batches are refused.
fn offers_dirs(caps: &[Capability]) -> bool {
    caps.iter()
        .find(|c| c.name == "dirs")
        .is_some_and(|c| c.value.split(',').any(|v| v == "1"))
}

/// Whether a hello turns the `finish` capability on: its first `finish` capability
/// lists `1`, and it turns `write` on too; otherwise `FileFinish` is refused.
fn offers_finish(caps: &[Capability]) -> bool {
    offers_write(caps)
        && caps
            .iter()
            .find(|c| c.name == "finish")
            .is_some_and(|c| c.value.split(',').any(|v| v == "1"))
}

/// Whether `body` is one of the requests of the `write` capability.
fn needs_write(body: &Request) -> bool {
    matches!(
        body,
        Request::FileOpen { .. }
            | Request::FileWrite { .. }
            | Request::FileRead { .. }
            | Request::FileSetAttr { .. }
            | Request::FileAllocate { .. }
            | Request::FileSync { .. }
            | Request::FileClose { .. }
            | Request::FileDiscard { .. }
            | Request::FileCommit { .. }
            | Request::FileFinish { .. }
            | Request::FilePut { .. }
            | Request::Move { .. }
            | Request::SetAttrs { .. }
            | Request::ShareAccess { .. }
            | Request::StatMeta { .. }
            | Request::Counters
    )
}

/// Whether `body` needs a capability this harness's server never offers (`locks`,
/// `xattr`, `falloc`, `posix`).
fn needs_unoffered(body: &Request) -> bool {
    matches!(
        body,
        Request::Lock { .. }
            | Request::LockTest { .. }
            | Request::LockRelease { .. }
            | Request::XattrGet { .. }
            | Request::XattrList { .. }
            | Request::XattrSet { .. }
            | Request::XattrRemove { .. }
            | Request::FileFallocate { .. }
            | Request::AsCaller { .. }
            | Request::MakeNode { .. }
            | Request::SetTimes { .. }
    )
}

/// A write of no extents: its region must be empty and it may carry no hashes.
fn nothing_to_write(region: &RegionDesc, hashes: &[Hash256]) -> Result<(), ErrorKind> {
    if region.len != 0 || !hashes.is_empty() {
        Err(ErrorKind::Protocol)
    } else {
        Ok(())
    }
}

/// The limits of a `FileWrite` (docs/protocol.md section 8), written out again.
fn write_shape(region: &RegionDesc, extents: &[Extent], hashes: &[Hash256]) -> Result<(), ErrorKind> {
    let most = (MAX_WINDOW_CHUNKS as u64 * u64::from(CHUNK_BYTES)).min(MAX_FILE_IO_BYTES);
    let sum: u64 = extents.iter().map(|e| u64::from(e.len)).sum();
    let bad = extents.is_empty()
        || extents.len() > MAX_WRITE_EXTENTS
        || hashes.len() != extents.len()
        || extents.iter().any(|e| {
            e.len == 0
                || e.len > CHUNK_BYTES
                || e.offset
                    .checked_add(u64::from(e.len))
                    .is_none_or(|end| end > i64::MAX as u64)
        })
        || sum != region.len
        || sum > most;
    if bad {
        Err(ErrorKind::Protocol)
    } else {
        Ok(())
    }
}

/// Whether a hello turns medium batches on: its first `batch` capability lists
/// `medium`; otherwise a batched file may hold at most `SMALL_FILE_MAX_BYTES`.
fn offers_medium(caps: &[Capability]) -> bool {
    caps.iter()
        .find(|c| c.name == "batch")
        .is_some_and(|c| c.value.split(',').any(|v| v == "medium"))
}

/// What the model expects the session to transmit.
#[derive(Debug)]
enum Transmit {
    Welcome,
    Refused,
    Response(u64, Response),
    /// An error response of this kind (its message is not modelled).
    Error(u64, ErrorKind),
}

/// What the model expects the session to report.
#[derive(Debug)]
enum Event {
    Ready(String),
    Request(u64),
    Authenticated(String),
    Denied(String),
    Closed(fn(&ProtoError) -> bool),
}

struct Harness {
    session: ServerSession,
    start: Instant,
    now: Instant,
    /// The model: the client's nonce once the handshake is done, session closed,
    /// outstanding request ids in order, shares proved, shares refused (reported once).
    ready: Option<Nonce>,
    /// The session negotiated `meta` (its metadata requests are admitted).
    meta: bool,
    /// The hash algorithm the welcome chose (`chosen_hash`).
    hash: &'static str,
    /// The session negotiated medium batches.
    medium: bool,
    /// The session negotiated `write`.
    write: bool,
    /// The session negotiated `dirs`.
    dirs: bool,
    /// The session negotiated `finish`.
    finish: bool,
    closed: bool,
    outstanding: Vec<u64>,
    authenticated: HashSet<String>,
    denied: HashSet<String>,
    transmits: VecDeque<Transmit>,
    events: VecDeque<Event>,
    tables: Tables,
}

/// How an admitted request changes the model's tables once it is answered.
#[derive(Debug, Clone, Copy)]
enum Pending {
    OpenTransfer(u64),
    Commit(u64),
    OpenMap(u64),
    OpenFile(u64),
}

/// The model of the connection's tables (`docs/protocol.md` section 2): transfer id →
/// (is an upload, is open), mapped-file handle → is open, and what each outstanding
/// request will change.
struct Tables {
    transfers: HashMap<u64, (bool, bool)>,
    next_transfer: u64,
    maps: HashMap<u64, bool>,
    next_map: u64,
    /// File handle → is open.
    files: HashMap<u64, bool>,
    next_file: u64,
    pending: HashMap<u64, Pending>,
}

impl Default for Tables {
    fn default() -> Tables {
        Tables {
            transfers: HashMap::new(),
            next_transfer: 1,
            maps: HashMap::new(),
            next_map: 1,
            files: HashMap::new(),
            next_file: 1,
            pending: HashMap::new(),
        }
    }
}

/// A request naming file handle `handle` is admitted only while it is open.
fn file_open(t: &Tables, handle: &u64) -> Result<(), ErrorKind> {
    match t.files.get(handle) {
        Some(true) => Ok(()),
        _ => Err(ErrorKind::Protocol),
    }
}

impl Tables {
    /// The refusal of request `id`, if the tables refuse it; else what it reserves.
    /// `medium`: the session negotiated medium batches.
    fn admit(&mut self, id: u64, body: &Request, medium: bool) -> Result<(), ErrorKind> {
        let open_of = |t: &Tables, transfer: &u64, upload: bool| match t.transfers.get(transfer) {
            Some(&(u, true)) if u == upload => Ok(()),
            _ => Err(ErrorKind::Protocol),
        };
        match body {
            Request::UploadOpen { .. }
            | Request::UploadOpenBase { .. }
            | Request::DownloadOpen { .. } => {
                if self.transfers.len() >= MAX_OPEN_TRANSFERS {
                    return Err(ErrorKind::Protocol);
                }
                let upload = !matches!(body, Request::DownloadOpen { .. });
                let t = self.next_transfer;
                self.next_transfer += 1;
                self.transfers.insert(t, (upload, false));
                self.pending.insert(id, Pending::OpenTransfer(t));
                Ok(())
            }
            Request::UploadWindow { transfer, .. } => open_of(self, transfer, true),
            Request::UploadCommit { transfer, .. } => {
                open_of(self, transfer, true)?;
                self.pending.insert(id, Pending::Commit(*transfer));
                Ok(())
            }
            Request::DownloadWindow { transfer, .. } => open_of(self, transfer, false),
            Request::Close { transfer } => match self.transfers.get(transfer) {
                Some((_, true)) => {
                    self.transfers.remove(transfer);
                    Ok(())
                }
                _ => Err(ErrorKind::Protocol),
            },
            Request::MapOpen { .. } => {
                if self.maps.len() >= MAX_OPEN_MAPS {
                    return Err(ErrorKind::Busy);
                }
                let h = self.next_map;
                self.next_map += 1;
                self.maps.insert(h, false);
                self.pending.insert(id, Pending::OpenMap(h));
                Ok(())
            }
            Request::MapRelease { handle } => match self.maps.get(handle) {
                Some(true) => {
                    self.maps.remove(handle);
                    Ok(())
                }
                _ => Err(ErrorKind::Protocol),
            },
            Request::FileOpen { .. } => {
                if self.files.len() >= MAX_OPEN_FILES {
                    return Err(ErrorKind::Busy);
                }
                let h = self.next_file;
                self.next_file += 1;
                self.files.insert(h, false);
                self.pending.insert(id, Pending::OpenFile(h));
                Ok(())
            }
            Request::FileFinish {
                handle,
                region,
                extents,
                hashes,
                ..
            } if extents.is_empty() => {
                file_open(self, handle)?;
                nothing_to_write(region, hashes)
            }
            // No handle: opened, written and closed within the request.
            Request::FilePut {
                region,
                extents,
                hashes,
                ..
            } if extents.is_empty() => nothing_to_write(region, hashes),
            Request::FileWrite {
                handle,
                region,
                extents,
                hashes,
                ..
            }
            | Request::FileFinish {
                handle,
                region,
                extents,
                hashes,
                ..
            } => {
                file_open(self, handle)?;
                write_shape(region, extents, hashes)
            }
            Request::FilePut {
                region,
                extents,
                hashes,
                ..
            } => write_shape(region, extents, hashes),
            Request::FileRead { handle, region, .. } => {
                file_open(self, handle)?;
                let most =
                    (MAX_WINDOW_CHUNKS as u64 * u64::from(CHUNK_BYTES)).min(MAX_FILE_IO_BYTES);
                if region.len == 0 || region.len > most {
                    Err(ErrorKind::Protocol)
                } else {
                    Ok(())
                }
            }
            Request::FileSetAttr { handle, .. }
            | Request::FileAllocate { handle, .. }
            | Request::FileSync { handle, .. }
            | Request::FileCommit { handle } => file_open(self, handle),
            Request::FileClose { handle } | Request::FileDiscard { handle } => {
                file_open(self, handle)?;
                self.files.remove(handle);
                Ok(())
            }
            Request::UploadBatch { region, files, .. } => {
                let capacity = BATCH_MAX_BYTES.min(u64::from(CHUNK_BYTES));
                let file_max = if medium {
                    capacity
                } else {
                    SMALL_FILE_MAX_BYTES.min(capacity)
                };
                let total: u64 = files.iter().map(|f| f.size).sum();
                let bad = files.is_empty()
                    || files.iter().any(|f| f.size > file_max)
                    || total != region.len
                    || region.len > BATCH_MAX_BYTES.min(u64::from(CHUNK_BYTES));
                if bad {
                    Err(ErrorKind::Protocol)
                } else {
                    Ok(())
                }
            }
            _ => Ok(()),
        }
    }

    /// Settles request `id` from its answer: a successful open is open, a failed one
    /// frees its slot, a successful commit closes its upload.
    fn settle(&mut self, id: u64, body: &Response) {
        let ok = !matches!(body, Response::Error(_));
        match self.pending.remove(&id) {
            Some(Pending::OpenTransfer(t)) => {
                if !ok {
                    self.transfers.remove(&t);
                } else if let Some(entry) = self.transfers.get_mut(&t) {
                    entry.1 = true;
                }
            }
            Some(Pending::Commit(t)) if ok => {
                self.transfers.remove(&t);
            }
            Some(Pending::OpenMap(h)) => {
                if ok {
                    self.maps.insert(h, true);
                } else {
                    self.maps.remove(&h);
                }
            }
            Some(Pending::OpenFile(h)) => {
                if ok {
                    self.files.insert(h, true);
                } else {
                    self.files.remove(&h);
                }
            }
            Some(Pending::Commit(_)) | None => {}
        }
    }

    /// The session closed: opens never answered leave the tables.
    fn close(&mut self) {
        for (_, p) in self.pending.drain() {
            match p {
                Pending::OpenTransfer(t) => {
                    self.transfers.remove(&t);
                }
                Pending::OpenMap(h) => {
                    self.maps.remove(&h);
                }
                Pending::OpenFile(h) => {
                    self.files.remove(&h);
                }
                Pending::Commit(_) => {}
            }
        }
    }
}

impl Harness {
    fn close(&mut self, why: fn(&ProtoError) -> bool) {
        self.closed = true;
        self.outstanding.clear();
        self.tables.close();
        self.events.push_back(Event::Closed(why));
    }

    fn receive_valid_auth(&mut self, bytes: &[u8]) {
        let mut id = [0u8; 8];
        let len = bytes.len().min(8);
        id[..len].copy_from_slice(&bytes[..len]);
        let share = String::from_utf8_lossy(&bytes[len..]).into_owned();
        let client_nonce = self.ready.unwrap_or_default();
        let proof = secret().client_proof(&share, &client_nonce, &SERVER_NONCE);
        let msg = Message::Request {
            id: u64::from_le_bytes(id),
            body: Request::Auth { share, proof },
        };
        if let Ok(bytes) = codec::encode(&msg) {
            self.receive(&bytes);
        }
    }

    /// The model of a request that passed the id checks.
    fn request(
        &mut self,
        id: u64,
        body: Request,
        client_nonce: Nonce,
    ) -> Result<(), fn(&ProtoError) -> bool> {
        if let Request::Auth { share, proof } = body {
            match share.as_str() {
                "pub" => self.transmits.push_back(Transmit::Response(
                    id,
                    Response::Authenticated { proof: None },
                )),
                "data"
                    if secret().check_client_proof(
                        &share,
                        &client_nonce,
                        &SERVER_NONCE,
                        &proof,
                    ) =>
                {
                    let proof = secret().server_proof(&share, &client_nonce, &SERVER_NONCE);
                    self.events.push_back(Event::Authenticated(share.clone()));
                    self.authenticated.insert(share);
                    self.transmits.push_back(Transmit::Response(
                        id,
                        Response::Authenticated { proof: Some(proof) },
                    ));
                }
                "data" => {
                    self.transmits
                        .push_back(Transmit::Error(id, ErrorKind::AuthFailed));
                    self.events.push_back(Event::Denied(share));
                    return Err(|e| matches!(e, ProtoError::AuthFailed(_)));
                }
                _ => self
                    .transmits
                    .push_back(Transmit::Error(id, ErrorKind::NoSuchShare)),
            }
            return Ok(());
        }
        // This server is no cluster node, and offers none of the mount's optional
        // capabilities (locks, xattr, falloc, posix): their requests are always refused.
        if (needs_write(&body) && !self.write)
            || matches!(body, Request::Replicate { .. })
            || needs_unoffered(&body)
        {
            self.transmits
                .push_back(Transmit::Error(id, ErrorKind::Protocol));
            return Ok(());
        }
        if matches!(body, Request::FileFinish { .. } | Request::FilePut { .. }) && !self.finish {
            self.transmits
                .push_back(Transmit::Error(id, ErrorKind::Protocol));
            return Ok(());
        }
        if matches!(body, Request::MakeDirs { .. } | Request::SetAttrBatch { .. }) && !self.dirs {
            self.transmits
                .push_back(Transmit::Error(id, ErrorKind::Protocol));
            return Ok(());
        }
        if matches!(body, Request::SetMeta { .. } | Request::ListDirMeta { .. }) && !self.meta {
            self.transmits
                .push_back(Transmit::Error(id, ErrorKind::Protocol));
            return Ok(());
        }
        if body.share() == Some("data") && !self.authenticated.contains("data") {
            self.transmits
                .push_back(Transmit::Error(id, ErrorKind::AuthRequired));
            if self.denied.insert("data".into()) {
                self.events.push_back(Event::Denied("data".into()));
            }
            return Ok(());
        }
        if let Err(kind) = self.tables.admit(id, &body, self.medium) {
            self.transmits.push_back(Transmit::Error(id, kind));
            return Ok(());
        }
        self.outstanding.push(id);
        self.events.push_back(Event::Request(id));
        Ok(())
    }

    fn receive(&mut self, bytes: &[u8]) {
        let Ok(msg) = codec::decode(bytes) else {
            return;
        };
        let result = self.session.handle_message(self.now, msg.clone());
        if self.closed {
            assert_eq!(result, Ok(()), "a closed session ignores input");
            return;
        }
        let expected: Result<(), fn(&ProtoError) -> bool> = match (self.ready, msg) {
            (None, Message::Hello(h)) => {
                if h.magic == HELLO_MAGIC
                    && (h.min_version..=h.max_version).contains(&PROTOCOL_VERSION)
                    && chosen_hash(&h.capabilities).is_some()
                {
                    self.ready = Some(h.nonce);
                    self.hash = chosen_hash(&h.capabilities).unwrap_or("sha256");
                    self.meta = offers_meta(&h.capabilities);
                    self.medium = offers_medium(&h.capabilities);
                    self.write = offers_write(&h.capabilities);
                    self.dirs = offers_dirs(&h.capabilities);
                    self.finish = offers_finish(&h.capabilities);
                    self.transmits.push_back(Transmit::Welcome);
                    self.events.push_back(Event::Ready(h.software));
                    Ok(())
                } else {
                    self.transmits.push_back(Transmit::Refused);
                    Err(|e| matches!(e, ProtoError::Incompatible(_)))
                }
            }
            (Some(client_nonce), Message::Request { id, body }) => {
                if self.outstanding.contains(&id) {
                    Err(|e| matches!(e, ProtoError::DuplicateRequest(_)))
                } else if self.outstanding.len() >= MAX_INFLIGHT_REQUESTS as usize {
                    Err(|e| matches!(e, ProtoError::TooManyRequests(_)))
                } else {
                    self.request(id, body, client_nonce)
                }
            }
            _ => Err(|e| matches!(e, ProtoError::Unexpected { .. })),
        };
        match (expected, result) {
            (Ok(()), Ok(())) => {}
            (Err(why), Err(e)) => {
                assert!(why(&e), "unexpected error {e:?}");
                self.close(why);
            }
            (expected, got) => panic!(
                "expected {}, got {got:?}",
                if expected.is_ok() { "Ok" } else { "an error" }
            ),
        }
    }

    fn advance(&mut self, r: Record<'_>) {
        let mut n = [0u8; 4];
        let len = r.bytes.len().min(4);
        n[..len].copy_from_slice(&r.bytes[..len]);
        let n = u64::from(u32::from_le_bytes(n));
        self.now += if r.flags & 4 != 0 {
            Duration::from_secs(n)
        } else {
            Duration::from_millis(n)
        };
        let due = self.session.poll_timeout().is_some_and(|t| t <= self.now);
        if due || r.flags & 8 != 0 {
            self.session.handle_timeout(self.now);
        }
        if self.ready.is_none() && !self.closed && self.now >= self.start + HANDSHAKE_TIMEOUT {
            self.close(|e| matches!(e, ProtoError::HandshakeTimeout));
        }
    }

    fn respond_outstanding(&mut self, bytes: &[u8]) {
        let Some((&k, rest)) = bytes.split_first() else {
            return;
        };
        if self.outstanding.is_empty() {
            return;
        }
        let id = self.outstanding[usize::from(k) % self.outstanding.len()];
        let body = match codec::decode(rest) {
            Ok(Message::Response { body, .. }) => body,
            _ => Response::Ok,
        };
        self.respond(id, body);
    }

    fn respond_any(&mut self, bytes: &[u8]) {
        let mut id = [0u8; 8];
        let len = bytes.len().min(8);
        id[..len].copy_from_slice(&bytes[..len]);
        self.respond(u64::from_le_bytes(id), Response::Ok);
    }

    fn respond(&mut self, id: u64, body: Response) {
        self.session.respond(id, body.clone());
        if let Some(i) = self.outstanding.iter().position(|&o| o == id) {
            self.outstanding.remove(i);
            self.tables.settle(id, &body);
            self.transmits.push_back(Transmit::Response(id, body));
        }
    }

    /// Drains the session's outputs and compares them with the model's.
    fn check_drained(&mut self) {
        while let Some(msg) = self.session.poll_transmit() {
            let bytes = codec::encode(&msg).expect("a transmitted message encodes");
            assert_eq!(codec::decode(&bytes).as_ref(), Ok(&msg));
            match (self.transmits.pop_front(), msg) {
                (Some(Transmit::Welcome), Message::Welcome(w)) => {
                    assert_eq!(w.version, PROTOCOL_VERSION);
                    assert_eq!(w.software, SOFTWARE);
                    assert_eq!(w.chunk_bytes, CHUNK_BYTES);
                    assert_eq!(w.max_window_chunks as usize, MAX_WINDOW_CHUNKS);
                    assert_eq!(w.max_inflight_requests, MAX_INFLIGHT_REQUESTS);
                    assert_eq!(w.nonce, SERVER_NONCE);
                    let mut caps = vec![Capability::new("hash", self.hash)];
                    if self.meta {
                        caps.push(Capability::new("meta", "1"));
                    }
                    if self.medium {
                        caps.push(Capability::new("batch", "medium"));
                    }
                    if self.write {
                        caps.push(Capability::new("write", "1"));
                    }
                    if self.dirs {
                        caps.push(Capability::new("dirs", "1"));
                    }
                    if self.finish {
                        caps.push(Capability::new("finish", "1"));
                    }
                    assert_eq!(w.capabilities, caps);
                }
                (Some(Transmit::Refused), Message::Refused(e)) => {
                    assert_eq!(e.kind, ErrorKind::Protocol);
                }
                (Some(Transmit::Response(id, body)), Message::Response { id: got, body: b }) => {
                    assert_eq!((got, &b), (id, &body));
                }
                (
                    Some(Transmit::Error(id, kind)),
                    Message::Response {
                        id: got,
                        body: Response::Error(e),
                    },
                ) => {
                    assert_eq!((got, e.kind), (id, kind));
                }
                (expected, got) => panic!("expected to transmit {expected:?}, got {got:?}"),
            }
        }
        assert!(
            self.transmits.is_empty(),
            "not transmitted: {:?}",
            self.transmits
        );
        while let Some(event) = self.session.poll_event() {
            match (self.events.pop_front(), event) {
                (Some(Event::Ready(s)), ServerEvent::Ready { software }) => {
                    assert_eq!(s, software);
                }
                (Some(Event::Request(id)), ServerEvent::Request { id: got, .. }) => {
                    assert_eq!(got, id);
                }
                (Some(Event::Authenticated(s)), ServerEvent::Authenticated { share }) => {
                    assert_eq!(s, share);
                }
                (Some(Event::Denied(s)), ServerEvent::Denied { share, .. }) => {
                    assert_eq!(s, share);
                }
                (Some(Event::Closed(why)), ServerEvent::Closed(e)) => {
                    assert!(why(&e), "closed for the wrong reason: {e:?}");
                }
                (expected, got) => panic!("expected event {expected:?}, got {got:?}"),
            }
        }
        assert!(self.events.is_empty(), "not reported: {:?}", self.events);
        assert!(self.outstanding.len() <= MAX_INFLIGHT_REQUESTS as usize);
        assert_eq!(self.session.is_closed(), self.closed);
        let deadline =
            (self.ready.is_none() && !self.closed).then(|| self.start + HANDSHAKE_TIMEOUT);
        assert_eq!(self.session.poll_timeout(), deadline);
    }
}
