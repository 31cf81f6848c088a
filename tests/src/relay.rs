//! The frame-aware TCP relay under [`WireProxy`](crate::WireProxy) and
//! [`TamperProxy`](crate::TamperProxy).
//!
//! A [`Relay`] listens on the upstream's host on an ephemeral port and connects each
//! accepted client to the upstream. Each connection gets two forwarding threads, one
//! per [`Direction`]; each reads its sender with a [`FrameReader`], which splits the
//! stream into the software transport's framing (`docs/protocol.md` section 1):
//!
//! ```text
//! greeting   : "FRYTCP" u16 version          (each side, once)
//! CTRL       : 0x01 u32 len payload[len]
//! READ_REQ   : 0x02 u64 id u32 rkey u64 addr u32 len
//! READ_RESP  : 0x03 u64 id u8 status [u32 len payload[len] if status == 0]
//! WRITE_REQ  : 0x04 u64 id u32 rkey u64 addr u32 len payload[len]
//! WRITE_RESP : 0x05 u64 id u8 status
//! ```
//!
//! What a thread forwards is up to the proxy's [`Forward`] for that direction: the
//! relay hands it the greeting, then every whole frame, and it writes what it passes on.
//! Control payloads are never decoded here.
//!
//! Ending: a sender's clean close is passed on as a half-close after
//! [`Forward::end`]; a frame that cannot be parsed (or a wrong greeting, which is
//! forwarded first) ends the connection, both sockets shut down, and is counted in
//! [`Relay::parse_errors`]. Dropping the [`Relay`] closes every socket and joins every
//! thread.

use std::io::{self, BufRead, BufReader, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use ferry_common::transport::tcp::wire::{
    CTRL, GREETING, READ_REQ, READ_RESP, STATUS_OK, WRITE_REQ, WRITE_RESP,
};

/// How often the accept loop looks at the stop flag.
const ACCEPT_POLL: Duration = Duration::from_millis(10);

/// Read buffer per direction.
const READ_BUF_BYTES: usize = 256 << 10;

/// Largest payload the relay accepts in one frame (a READ or WRITE of one window is
/// far smaller); a bigger length is treated as a parse error, not allocated.
const MAX_FRAME_PAYLOAD_BYTES: u32 = 1 << 30;

/// Which way a frame travels.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Direction {
    /// From the server to the client: its control answers, and the answers to READs
    /// the client issued against the server's memory (a mount's or a download's reads
    /// of mapped files).
    ServerToClient,
    /// From the client to the server: its control requests, and the answers to READs
    /// the server issued against the client's memory (an upload: the server pulls the
    /// client's source window).
    ClientToServer,
}

pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|poison| poison.into_inner())
}

fn bad(what: String) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, what)
}

/// The time left before `deadline`, `None` once it passed.
pub(crate) fn left_until(deadline: Instant) -> Option<Duration> {
    deadline
        .checked_duration_since(Instant::now())
        .filter(|left| !left.is_zero())
}

/// What a frame is, with the header fields the proxies look at.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Head {
    /// A control frame; its payload is opaque here.
    Ctrl,
    /// A READ request.
    ReadReq {
        id: u64,
        rkey: u32,
        addr: u64,
        len: u32,
    },
    /// A READ response; a payload follows only when `status` is `STATUS_OK`.
    ReadResp { id: u64, status: u8 },
    /// A WRITE request with its payload.
    WriteReq,
    /// A WRITE acknowledgement.
    WriteResp,
}

/// One whole frame as it travelled: header bytes, then the payload from `payload_at`.
#[derive(Debug)]
pub(crate) struct Frame {
    pub(crate) head: Head,
    pub(crate) bytes: Vec<u8>,
    payload_at: usize,
}

impl Frame {
    pub(crate) fn payload(&self) -> &[u8] {
        &self.bytes[self.payload_at..]
    }

    pub(crate) fn payload_mut(&mut self) -> &mut [u8] {
        &mut self.bytes[self.payload_at..]
    }
}

/// The sending socket, read field by field.
struct Source(BufReader<TcpStream>);

impl Source {
    /// Fills `buf`; `Ok(false)` on a clean end of stream before the first byte.
    fn read_exact_or_eof(&mut self, buf: &mut [u8]) -> io::Result<bool> {
        let mut filled = 0;
        while filled < buf.len() {
            match self.0.read(&mut buf[filled..]) {
                Ok(0) if filled == 0 => return Ok(false),
                Ok(0) => return Err(bad("stream ended inside a frame".into())),
                Ok(n) => filled += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        Ok(true)
    }

    /// Reads `N` bytes inside a frame and appends them to `frame`.
    fn field<const N: usize>(&mut self, frame: &mut Vec<u8>) -> io::Result<[u8; N]> {
        let mut bytes = [0u8; N];
        if !self.read_exact_or_eof(&mut bytes)? {
            return Err(bad("stream ended inside a frame".into()));
        }
        frame.extend_from_slice(&bytes);
        Ok(bytes)
    }

    fn u8(&mut self, frame: &mut Vec<u8>) -> io::Result<u8> {
        Ok(self.field::<1>(frame)?[0])
    }

    fn u32(&mut self, frame: &mut Vec<u8>) -> io::Result<u32> {
        Ok(u32::from_le_bytes(self.field(frame)?))
    }

    fn u64(&mut self, frame: &mut Vec<u8>) -> io::Result<u64> {
        Ok(u64::from_le_bytes(self.field(frame)?))
    }

    /// Reads a `len`-byte payload and appends it to `frame`.
    fn payload(&mut self, frame: &mut Vec<u8>, len: u32) -> io::Result<()> {
        if len > MAX_FRAME_PAYLOAD_BYTES {
            return Err(bad(format!("frame payload of {len} bytes")));
        }
        let start = frame.len();
        frame.resize(start + len as usize, 0);
        if len > 0 && !self.read_exact_or_eof(&mut frame[start..])? {
            return Err(bad("stream ended inside a frame".into()));
        }
        Ok(())
    }
}

/// Splits one direction of a connection into the greeting and whole frames.
pub(crate) struct FrameReader {
    source: Source,
    /// The last frame read; its buffer is reused.
    frame: Frame,
}

impl FrameReader {
    fn new(from: TcpStream) -> FrameReader {
        FrameReader {
            source: Source(BufReader::with_capacity(READ_BUF_BYTES, from)),
            frame: Frame {
                head: Head::Ctrl,
                bytes: Vec::new(),
                payload_at: 0,
            },
        }
    }

    fn socket(&self) -> &TcpStream {
        self.source.0.get_ref()
    }

    /// The 8 greeting bytes, whatever they are; `None` if the sender closed first.
    fn read_greeting(&mut self) -> io::Result<Option<[u8; GREETING.len()]>> {
        let mut greeting = [0u8; GREETING.len()];
        Ok(self
            .source
            .read_exact_or_eof(&mut greeting)?
            .then_some(greeting))
    }

    /// The next whole frame; `None` when the sender closed cleanly between frames.
    /// Fails with `InvalidData` on bytes that are not the framing.
    fn read_frame(&mut self) -> io::Result<Option<&mut Frame>> {
        let FrameReader { source, frame } = self;
        let mut kind = [0u8; 1];
        if !source.read_exact_or_eof(&mut kind)? {
            return Ok(None);
        }
        let bytes = &mut frame.bytes;
        bytes.clear();
        bytes.push(kind[0]);
        let (head, payload_len) = match kind[0] {
            CTRL => (Head::Ctrl, Some(source.u32(bytes)?)),
            READ_REQ => {
                let head = Head::ReadReq {
                    id: source.u64(bytes)?,
                    rkey: source.u32(bytes)?,
                    addr: source.u64(bytes)?,
                    len: source.u32(bytes)?,
                };
                (head, None)
            }
            READ_RESP => {
                let id = source.u64(bytes)?;
                let status = source.u8(bytes)?;
                let len = if status == STATUS_OK {
                    Some(source.u32(bytes)?)
                } else {
                    None
                };
                (Head::ReadResp { id, status }, len)
            }
            WRITE_REQ => {
                source.u64(bytes)?;
                source.u32(bytes)?;
                source.u64(bytes)?;
                (Head::WriteReq, Some(source.u32(bytes)?))
            }
            WRITE_RESP => {
                source.u64(bytes)?;
                source.u8(bytes)?;
                (Head::WriteResp, None)
            }
            other => return Err(bad(format!("unknown frame kind 0x{other:02x}"))),
        };
        frame.head = head;
        frame.payload_at = bytes.len();
        if let Some(len) = payload_len {
            source.payload(bytes, len)?;
        }
        Ok(Some(frame))
    }

    /// Waits, between frames, until the sender has sent more (or closed): `Ok(true)`,
    /// or until `deadline` passes: `Ok(false)`.
    fn wait_until(&mut self, deadline: Instant) -> io::Result<bool> {
        if !self.source.0.buffer().is_empty() {
            return Ok(true);
        }
        let Some(left) = left_until(deadline) else {
            return Ok(false);
        };
        self.socket().set_read_timeout(Some(left))?;
        let arrived = loop {
            match self.source.0.fill_buf() {
                // Bytes, or an empty buffer at the end of the stream.
                Ok(_) => break Ok(true),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e)
                    if matches!(
                        e.kind(),
                        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                    ) =>
                {
                    break Ok(false)
                }
                Err(e) => break Err(e),
            }
        };
        self.socket().set_read_timeout(None)?;
        arrived
    }
}

/// What a proxy does with one direction of one connection. The relay calls
/// [`Forward::send`] with the greeting, then [`Forward::frame`] with each frame (and
/// [`Forward::idle`] whenever [`Forward::deadline`] passes between frames), and
/// [`Forward::end`] when the sender closes cleanly.
pub(crate) trait Forward: Send {
    /// Passes `bytes` on unchanged.
    fn send(&mut self, to: &mut TcpStream, bytes: &[u8]) -> io::Result<()> {
        to.write_all(bytes)
    }

    /// Handles one whole frame; what it writes to `to` is what the receiver gets.
    fn frame(&mut self, frame: &mut Frame, to: &mut TcpStream) -> io::Result<()>;

    /// When [`Forward::idle`] is due if no frame arrives first; `None`: never.
    fn deadline(&self) -> Option<Instant> {
        None
    }

    /// The deadline passed with no frame; must move or clear the deadline.
    fn idle(&mut self, _to: &mut TcpStream) -> io::Result<()> {
        Ok(())
    }

    /// The sender closed between frames; the relay half-closes `to` after this.
    fn end(&mut self, _to: &mut TcpStream) -> io::Result<()> {
        Ok(())
    }
}

/// The forwarders of a new connection, by its index (0 for the first accepted):
/// `[client to server, server to client]`.
type Connect = dyn FnMut(u64) -> [Box<dyn Forward>; 2] + Send;

/// A running relay; see the module docs.
#[derive(Debug)]
pub(crate) struct Relay {
    addr: SocketAddr,
    shared: Arc<Shared>,
    accept: Option<JoinHandle<()>>,
}

#[derive(Debug)]
struct Shared {
    /// The proxy's name in messages and thread names, e.g. `wire proxy`.
    name: &'static str,
    upstream: SocketAddr,
    stop: AtomicBool,
    connections: AtomicU64,
    parse_errors: AtomicU64,
    /// Clones of every socket, so drop can shut them down and wake the threads.
    sockets: Mutex<Vec<TcpStream>>,
    pumps: Mutex<Vec<JoinHandle<()>>>,
}

impl Relay {
    /// Starts a relay named `name` in front of `upstream` (`HOST:PORT`), listening on
    /// the same host with an ephemeral port; `connect` makes each connection's
    /// forwarders once its upstream connection is open.
    pub(crate) fn start(
        name: &'static str,
        upstream: &str,
        connect: impl FnMut(u64) -> [Box<dyn Forward>; 2] + Send + 'static,
    ) -> Relay {
        let upstream: SocketAddr = upstream
            .parse()
            .unwrap_or_else(|e| panic!("proxy upstream {upstream:?} is not HOST:PORT: {e}"));
        let listener = TcpListener::bind(SocketAddr::new(upstream.ip(), 0))
            .unwrap_or_else(|e| panic!("proxy cannot listen on {}: {e}", upstream.ip()));
        listener
            .set_nonblocking(true)
            .expect("set the proxy's listener non-blocking");
        let addr = listener.local_addr().expect("proxy's local address");
        let shared = Arc::new(Shared {
            name,
            upstream,
            stop: AtomicBool::new(false),
            connections: AtomicU64::new(0),
            parse_errors: AtomicU64::new(0),
            sockets: Mutex::new(Vec::new()),
            pumps: Mutex::new(Vec::new()),
        });
        let accept = {
            let shared = shared.clone();
            thread::Builder::new()
                .name(format!("{}-accept", name.replace(' ', "-")))
                .spawn(move || accept_loop(listener, shared, Box::new(connect)))
                .expect("spawn the proxy's accept thread")
        };
        Relay {
            addr,
            shared,
            accept: Some(accept),
        }
    }

    /// The address clients connect to, e.g. `127.0.0.1:41235`.
    pub(crate) fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// `HOST:PORT:share/path` through the relay (`HOST:PORT:share` for an empty path).
    pub(crate) fn remote(&self, share: &str, path: &str) -> String {
        if path.is_empty() {
            format!("{}:{share}", self.addr)
        } else {
            format!("{}:{share}/{path}", self.addr)
        }
    }

    /// Connections accepted (and connected upstream) so far.
    pub(crate) fn connections(&self) -> u64 {
        self.shared.connections.load(Ordering::SeqCst)
    }

    /// Connections ended because a frame could not be parsed.
    pub(crate) fn parse_errors(&self) -> u64 {
        self.shared.parse_errors.load(Ordering::SeqCst)
    }
}

/// The public accessors a proxy type built on a [`Relay`] has, delegated to its
/// `relay` field.
macro_rules! relay_accessors {
    () => {
        /// The address clients connect to, e.g. `127.0.0.1:41235`.
        pub fn addr(&self) -> std::net::SocketAddr {
            self.relay.addr()
        }

        /// The remote argument for `path` in `share` through the proxy:
        /// `HOST:PORT:share/path` (`HOST:PORT:share` when `path` is empty).
        pub fn remote(&self, share: &str, path: &str) -> String {
            self.relay.remote(share, path)
        }

        /// Connections accepted so far.
        pub fn connections(&self) -> u64 {
            self.relay.connections()
        }

        /// Connections ended because a frame could not be parsed.
        pub fn parse_errors(&self) -> u64 {
            self.relay.parse_errors()
        }
    };
}
pub(crate) use relay_accessors;

impl Drop for Relay {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        if let Some(accept) = self.accept.take() {
            // A panic in the accept thread was already reported by the thread itself.
            let _ = accept.join();
        }
        for socket in lock(&self.shared.sockets).drain(..) {
            // Wakes a pump blocked in read; the socket may be closed already.
            let _ = socket.shutdown(Shutdown::Both);
        }
        let pumps: Vec<JoinHandle<()>> = lock(&self.shared.pumps).drain(..).collect();
        for pump in pumps {
            let _ = pump.join();
        }
    }
}

fn accept_loop(listener: TcpListener, shared: Arc<Shared>, mut connect: Box<Connect>) {
    while !shared.stop.load(Ordering::SeqCst) {
        match listener.accept() {
            Ok((client, _)) => {
                if let Err(e) = start_connection(client, &shared, &mut connect) {
                    eprintln!(
                        "{}: cannot connect to {}: {e}",
                        shared.name, shared.upstream
                    );
                }
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => thread::sleep(ACCEPT_POLL),
            Err(e) => {
                eprintln!("{}: accept failed: {e}", shared.name);
                thread::sleep(ACCEPT_POLL);
            }
        }
    }
}

fn start_connection(
    client: TcpStream,
    shared: &Arc<Shared>,
    connect: &mut Box<Connect>,
) -> io::Result<()> {
    client.set_nonblocking(false)?;
    let server = TcpStream::connect_timeout(&shared.upstream, Duration::from_secs(10))?;
    for s in [&client, &server] {
        s.set_nodelay(true)?;
    }
    {
        let mut sockets = lock(&shared.sockets);
        sockets.push(client.try_clone()?);
        sockets.push(server.try_clone()?);
    }
    let index = shared.connections.fetch_add(1, Ordering::SeqCst);
    let [to_server, to_client] = connect(index);
    let mut pumps = Vec::new();
    for (direction, from, to, forward) in [
        (
            Direction::ClientToServer,
            client.try_clone()?,
            server.try_clone()?,
            to_server,
        ),
        (Direction::ServerToClient, server, client, to_client),
    ] {
        let shared = shared.clone();
        let name = format!("{}-{direction:?}", shared.name.replace(' ', "-"));
        pumps.push(thread::Builder::new().name(name).spawn(move || {
            pump_thread(&shared, direction, from, to, forward);
        })?);
    }
    lock(&shared.pumps).extend(pumps);
    Ok(())
}

fn pump_thread(
    shared: &Shared,
    direction: Direction,
    from: TcpStream,
    mut to: TcpStream,
    mut forward: Box<dyn Forward>,
) {
    let mut reader = FrameReader::new(from);
    match pump(&mut reader, &mut to, forward.as_mut()) {
        // The sender closed: pass the half-close on, the other direction goes on.
        Ok(()) => {
            let _ = to.shutdown(Shutdown::Write);
        }
        Err(e) => {
            if e.kind() == io::ErrorKind::InvalidData {
                shared.parse_errors.fetch_add(1, Ordering::SeqCst);
                eprintln!(
                    "{} ({direction:?}): {e}; closing the connection",
                    shared.name
                );
            }
            let _ = to.shutdown(Shutdown::Both);
            let _ = reader.socket().shutdown(Shutdown::Both);
        }
    }
}

/// Forwards the greeting, then frames until the sender closes (`Ok`) or something
/// fails (`Err`; `InvalidData` for a stream that is not the Ferry framing).
fn pump(reader: &mut FrameReader, to: &mut TcpStream, forward: &mut dyn Forward) -> io::Result<()> {
    let Some(greeting) = reader.read_greeting()? else {
        return Ok(());
    };
    forward.send(to, &greeting)?;
    if greeting != GREETING {
        return Err(bad(format!("unexpected greeting {greeting:02x?}")));
    }
    loop {
        if let Some(deadline) = forward.deadline() {
            if !reader.wait_until(deadline)? {
                forward.idle(to)?;
                continue;
            }
        }
        let Some(frame) = reader.read_frame()? else {
            return forward.end(to);
        };
        forward.frame(frame, to)?;
    }
}
