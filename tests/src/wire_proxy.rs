//! A TCP proxy for the software transport that forwards every frame and can flip bits
//! in the data of one-sided READs while they are on the wire.
//!
//! The proxy speaks the framing of `docs/protocol.md` section 1: it forwards the
//! 8-byte greeting each way, then parses every frame in both directions (`CTRL`,
//! `READ_REQ`, `READ_RESP`, `WRITE_REQ`, `WRITE_RESP`) and forwards it unchanged,
//! except for the `READ_RESP` frames a [`Corruption`] selects, in which it flips the
//! lowest bit of one payload byte. To let a test name *what* it corrupts, the proxy
//! remembers
//!
//! - each `READ_REQ` (`id -> rkey, addr, len`), so a `READ_RESP` is matched with the
//!   region range it answers, and
//! - each `Mapped` answer the server sends in a `CTRL` frame (decoded with
//!   `ferry_common::codec`), so a read of a mapped file's region is known as
//!   "bytes `offset..offset+len` of a file of `file_size` bytes" or "its manifest".
//!
//! ```text
//! client ──▶ proxy ──▶ ferryd        READ_REQ  recorded per direction
//! client ◀── proxy ◀── ferryd        READ_RESP matched, maybe one bit flipped
//! ```
//!
//! The framing, the threads and the teardown are the relay's (`relay.rs`, shared with
//! the [`TamperProxy`](crate::TamperProxy)): each accepted connection runs two
//! forwarding threads; dropping the [`WireProxy`] closes every socket and joins every
//! thread. A frame the proxy cannot parse ends
//! that connection (both sockets are shut down), and is counted in
//! [`WireProxy::parse_errors`].

use std::collections::HashMap;
use std::io::{self, Write};
use std::net::TcpStream;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use ferry_common::codec;
use ferry_common::msg::{Message, Response};
use ferry_common::transport::tcp::wire::STATUS_OK;

use crate::relay::{lock, relay_accessors, Direction, Forward, Frame, Head, Relay};

/// What a READ covered, as far as the proxy could tell.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReadTarget {
    /// Bytes `offset .. offset + len` of a mapped file of `file_size` bytes.
    FileData {
        /// Size of the mapped file.
        file_size: u64,
        /// File offset of the first byte read.
        offset: u64,
    },
    /// Part of the manifest region (chunk hashes) of a mapped file of `file_size` bytes.
    Manifest {
        /// Size of the mapped file.
        file_size: u64,
    },
    /// A region the proxy saw no `Mapped` answer for (e.g. an upload's source window).
    Unknown,
}

/// One READ whose response passed through the proxy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReadInfo {
    /// The region key the READ named.
    pub rkey: u32,
    /// The remote address the READ started at.
    pub addr: u64,
    /// Bytes read (the response payload's length).
    pub len: u32,
    /// What those bytes are.
    pub target: ReadTarget,
}

/// One bit flip the proxy made.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Flip {
    /// The READ whose response was changed.
    pub read: ReadInfo,
    /// Index of the changed byte in the response payload.
    pub at: usize,
}

impl Flip {
    /// The file offset of the changed byte, when the READ was of mapped file data.
    pub fn file_offset(&self) -> Option<u64> {
        match self.read.target {
            ReadTarget::FileData { offset, .. } => Some(offset + self.at as u64),
            _ => None,
        }
    }
}

type Selector = dyn Fn(&ReadInfo) -> Option<usize> + Send + Sync;

/// Which READ responses the proxy damages: those travelling in `direction` for which
/// the selector returns the index of a payload byte, at most `limit` of them.
#[derive(Clone)]
pub struct Corruption {
    direction: Direction,
    select: Arc<Selector>,
    limit: Option<u64>,
}

impl std::fmt::Debug for Corruption {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Corruption")
            .field("direction", &self.direction)
            .field("limit", &self.limit)
            .finish_non_exhaustive()
    }
}

impl Corruption {
    /// Flips the lowest bit of payload byte `select(read)` of every READ response going
    /// `direction` for which `select` returns `Some` (an index past the payload's end
    /// is ignored).
    pub fn new(
        direction: Direction,
        select: impl Fn(&ReadInfo) -> Option<usize> + Send + Sync + 'static,
    ) -> Corruption {
        Corruption {
            direction,
            select: Arc::new(select),
            limit: None,
        }
    }

    /// Stops after `flips` flips; later responses pass unchanged.
    pub fn limit(mut self, flips: u64) -> Corruption {
        self.limit = Some(flips);
        self
    }

    /// Every server-to-client READ of mapped file data that covers byte `offset` of a
    /// file of `file_size` bytes gets that byte flipped: a persistent corruption of one
    /// chunk of that file, whoever reads it and however often.
    pub fn file_byte(file_size: u64, offset: u64) -> Corruption {
        Corruption::new(Direction::ServerToClient, move |read| match read.target {
            ReadTarget::FileData {
                file_size: size,
                offset: start,
            } if size == file_size && (start..start + u64::from(read.len)).contains(&offset) => {
                usize::try_from(offset - start).ok()
            }
            _ => None,
        })
    }

    /// Every READ response going `direction` whose payload is at least 4096 bytes and a
    /// multiple of 4096 gets its middle byte flipped (whatever region it came from).
    pub fn page_multiples(direction: Direction) -> Corruption {
        Corruption::new(direction, |read| {
            let len = read.len as usize;
            (len >= 4096 && len & 4095 == 0).then_some(len / 2)
        })
    }
}

/// A running proxy: listens on `127.0.0.1` (or the upstream's host) on an ephemeral
/// port and forwards each connection to the upstream address.
#[derive(Debug)]
pub struct WireProxy {
    relay: Relay,
    state: Arc<State>,
}

/// What the proxy's threads share besides the relay.
#[derive(Debug)]
struct State {
    corruption: Option<Corruption>,
    read_responses: AtomicU64,
    flips: Mutex<Vec<Flip>>,
}

impl WireProxy {
    /// Starts a proxy in front of `upstream` (`HOST:PORT`, e.g. [`crate::Server::addr`]),
    /// listening on the same host with an ephemeral port. `corruption` `None` forwards
    /// everything unchanged.
    pub fn start(upstream: &str, corruption: Option<Corruption>) -> WireProxy {
        let state = Arc::new(State {
            corruption,
            read_responses: AtomicU64::new(0),
            flips: Mutex::new(Vec::new()),
        });
        let relay = {
            let state = state.clone();
            Relay::start("wire proxy", upstream, move |_| {
                let conn = Arc::new(Conn::default());
                [Direction::ClientToServer, Direction::ServerToClient].map(|direction| {
                    Box::new(Pump {
                        direction,
                        state: state.clone(),
                        conn: conn.clone(),
                    }) as Box<dyn Forward>
                })
            })
        };
        WireProxy { relay, state }
    }

    relay_accessors!();

    /// READ responses seen so far travelling in the corruption's direction (both
    /// directions when there is no corruption).
    pub fn read_responses(&self) -> u64 {
        self.state.read_responses.load(Ordering::SeqCst)
    }

    /// Every flip made so far, in order.
    pub fn flips(&self) -> Vec<Flip> {
        lock(&self.state.flips).clone()
    }

    /// How many flips were made so far.
    pub fn flip_count(&self) -> u64 {
        lock(&self.state.flips).len() as u64
    }
}

/// The per-connection state both pumps share.
#[derive(Debug, Default)]
struct Conn {
    /// READ_REQs the client sent (answered by the server): `id -> (rkey, addr, len)`.
    client_reads: Mutex<HashMap<u64, (u32, u64, u32)>>,
    /// READ_REQs the server sent (answered by the client).
    server_reads: Mutex<HashMap<u64, (u32, u64, u32)>>,
    /// Regions of mapped files the server announced: `rkey -> region`.
    mapped: Mutex<HashMap<u32, MappedRegion>>,
}

#[derive(Debug, Clone, Copy)]
struct MappedRegion {
    addr: u64,
    file_size: u64,
    /// File offset of the region's first byte; `None` for the manifest region.
    file_offset: Option<u64>,
}

/// Watches one direction of one connection, frame by frame.
struct Pump {
    direction: Direction,
    state: Arc<State>,
    conn: Arc<Conn>,
}

impl Forward for Pump {
    fn frame(&mut self, frame: &mut Frame, to: &mut TcpStream) -> io::Result<()> {
        match frame.head {
            Head::Ctrl if self.direction == Direction::ServerToClient => {
                self.learn_mapping(frame.payload());
            }
            Head::ReadReq {
                id,
                rkey,
                addr,
                len,
            } => {
                lock(self.requests_sent()).insert(id, (rkey, addr, len));
            }
            Head::ReadResp { id, status } => {
                let request = lock(self.requests_answered()).remove(&id);
                if status == STATUS_OK {
                    self.maybe_flip(request, frame.payload_mut());
                }
            }
            _ => {}
        }
        to.write_all(&frame.bytes)
    }
}

impl Pump {
    /// The table of READs this pump's sender issued.
    fn requests_sent(&self) -> &Mutex<HashMap<u64, (u32, u64, u32)>> {
        match self.direction {
            Direction::ClientToServer => &self.conn.client_reads,
            Direction::ServerToClient => &self.conn.server_reads,
        }
    }

    /// The table of READs this pump's sender answers (issued by the other side).
    fn requests_answered(&self) -> &Mutex<HashMap<u64, (u32, u64, u32)>> {
        match self.direction {
            Direction::ClientToServer => &self.conn.server_reads,
            Direction::ServerToClient => &self.conn.client_reads,
        }
    }

    /// Remembers the regions of a `Mapped` answer, if `payload` is one.
    fn learn_mapping(&self, payload: &[u8]) {
        let Ok(Message::Response {
            body: Response::Mapped(file),
            ..
        }) = codec::decode(payload)
        else {
            return;
        };
        let size = file.version.size;
        let mut mapped = lock(&self.conn.mapped);
        for (i, region) in file.regions.iter().enumerate() {
            mapped.insert(
                region.rkey,
                MappedRegion {
                    addr: region.addr,
                    file_size: size,
                    file_offset: Some(i as u64 * file.window_bytes),
                },
            );
        }
        if let Some(manifest) = file.manifest {
            mapped.insert(
                manifest.rkey,
                MappedRegion {
                    addr: manifest.addr,
                    file_size: size,
                    file_offset: None,
                },
            );
        }
    }

    fn maybe_flip(&self, request: Option<(u32, u64, u32)>, payload: &mut [u8]) {
        let Some(corruption) = &self.state.corruption else {
            self.state.read_responses.fetch_add(1, Ordering::SeqCst);
            return;
        };
        if corruption.direction != self.direction {
            return;
        }
        self.state.read_responses.fetch_add(1, Ordering::SeqCst);
        let (rkey, addr) = request.map_or((0, 0), |(rkey, addr, _)| (rkey, addr));
        let target =
            match request.and_then(|(rkey, ..)| lock(&self.conn.mapped).get(&rkey).copied()) {
                Some(region) => match region.file_offset {
                    Some(base) => ReadTarget::FileData {
                        file_size: region.file_size,
                        offset: base + addr.wrapping_sub(region.addr),
                    },
                    None => ReadTarget::Manifest {
                        file_size: region.file_size,
                    },
                },
                None => ReadTarget::Unknown,
            };
        let read = ReadInfo {
            rkey,
            addr,
            len: payload.len() as u32,
            target,
        };
        let Some(at) = (corruption.select)(&read).filter(|&at| at < payload.len()) else {
            return;
        };
        let mut flips = lock(&self.state.flips);
        if corruption
            .limit
            .is_some_and(|limit| flips.len() as u64 >= limit)
        {
            return;
        }
        payload[at] ^= 0x01;
        flips.push(Flip { read, at });
    }
}

#[cfg(test)]
mod tests {
    //! The proxy against a real ferryd and the real rcp: uploads are the server's READs
    //! of the client, so their READ responses travel client to server.

    use super::*;
    use crate::{assert_entries, assert_files_equal, rcp, write_random_file, Env, MIB};

    /// The proxy speaks the tcp transport only.
    fn on_tcp() -> bool {
        if crate::test_transport() == "tcp" {
            return true;
        }
        eprintln!("skipped: the wire proxy speaks the tcp transport only");
        false
    }

    fn upload_through(env: &Env, proxy: &WireProxy, name: &str) -> crate::RcpOutput {
        rcp([
            "--transport".into(),
            "tcp".into(),
            // The proxy flips plaintext data: a session in the clear.
            "--encryption".into(),
            "off".into(),
            env.local(name).into_os_string(),
            proxy.remote(crate::DEFAULT_SHARE, name).into(),
        ])
    }

    #[test]
    fn a_transparent_proxy_changes_nothing() {
        if !on_tcp() {
            return;
        }
        let env = Env::new();
        write_random_file(&env.local("up.bin"), 3 * MIB + 5, 1);
        let proxy = WireProxy::start(env.server().addr(), None);
        upload_through(&env, &proxy, "up.bin").assert_success();
        assert_files_equal(&env.local("up.bin"), &env.share("up.bin"));
        let back = env.local("back.bin");
        rcp([
            "--transport".into(),
            "tcp".into(),
            proxy.remote(crate::DEFAULT_SHARE, "up.bin").into(),
            back.clone().into_os_string(),
        ])
        .assert_success();
        assert_files_equal(&env.local("up.bin"), &back);
        assert_eq!(proxy.connections(), 2);
        // 3 MiB + 5 in 1 MiB chunks: four READs of the upload's source.
        assert!(proxy.read_responses() >= 4, "{}", proxy.read_responses());
        assert_eq!((proxy.parse_errors(), proxy.flip_count()), (0, 0));
    }

    #[test]
    fn persistent_flips_fail_an_upload_with_an_integrity_error() {
        if !on_tcp() {
            return;
        }
        let env = Env::new();
        write_random_file(&env.local("up.bin"), 3 * MIB + 5, 2);
        let proxy = WireProxy::start(
            env.server().addr(),
            Some(Corruption::page_multiples(Direction::ClientToServer)),
        );
        upload_through(&env, &proxy, "up.bin")
            .assert_code(6)
            .assert_stderr_has_any(&["blake3 verification", "integrity"]);
        assert_entries(&env.share(""), &[]);
        let flips = proxy.flips();
        assert!(!flips.is_empty());
        for flip in flips {
            assert_eq!(flip.read.target, ReadTarget::Unknown);
            assert_eq!(flip.read.len as u64, MIB, "only whole 1 MiB chunks are hit");
            assert_eq!(flip.at as u64, MIB / 2);
        }
    }

    #[test]
    fn one_flip_is_detected_and_the_upload_retried() {
        if !on_tcp() {
            return;
        }
        let env = Env::new();
        write_random_file(&env.local("up.bin"), 3 * MIB + 5, 3);
        let proxy = WireProxy::start(
            env.server().addr(),
            Some(Corruption::page_multiples(Direction::ClientToServer).limit(1)),
        );
        upload_through(&env, &proxy, "up.bin").assert_success();
        assert_files_equal(&env.local("up.bin"), &env.share("up.bin"));
        assert_eq!(proxy.flip_count(), 1);
    }

    #[test]
    fn flips_in_the_other_direction_leave_uploads_alone() {
        if !on_tcp() {
            return;
        }
        let env = Env::new();
        write_random_file(&env.local("up.bin"), 2 * MIB + 1, 4);
        let proxy = WireProxy::start(
            env.server().addr(),
            Some(Corruption::page_multiples(Direction::ServerToClient)),
        );
        upload_through(&env, &proxy, "up.bin").assert_success();
        assert_files_equal(&env.local("up.bin"), &env.share("up.bin"));
        assert_eq!(proxy.flip_count(), 0);
    }
}
