//! A TCP proxy for the software transport that records every byte it forwards and can
//! tamper with one frame: flip a bit in, drop, repeat or reorder a control frame, or
//! flip a bit in the data of a one-sided READ or WRITE.
//!
//! Unlike the [`WireProxy`](crate::WireProxy), it never decodes a control payload: the
//! payloads may be encrypted, so the proxy only counts `CTRL` frames and treats their
//! payloads as opaque bytes. The framing, the two threads per connection and the
//! teardown on drop are the relay's (`relay.rs`).
//!
//! ```text
//! client ──▶ proxy ──▶ upstream       each direction recorded, per connection
//!              │
//!              └─ one Fault: the nth CTRL (or data) frame of one direction flipped,
//!                 dropped, sent twice or held back behind the next CTRL frame
//! ```
//!
//! - Recording: [`TamperProxy::recorded`] is what the proxy forwarded on one connection
//!   in one direction, greeting included, as the receiver got it (after any tampering).
//!   Recording stops for good once [`RECORDING_CAP_BYTES`] were kept over all streams
//!   ([`TamperProxy::recording_truncated`]); each stream is then a prefix of what went
//!   through. Forwarding goes on.
//! - Faults: a [`Fault`] fires at most once per proxy, on the first connection (or the
//!   one it names) whose frames reach its `nth`; [`TamperProxy::fired`] says whether it
//!   did.
//! - [`replay`] sends a recorded client-to-server stream to the upstream again on a
//!   fresh connection and reports what came back.

use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use ferry_common::transport::tcp::wire::STATUS_OK;
use memchr::memmem;

use crate::relay::{left_until, lock, relay_accessors, Direction, Forward, Frame, Head, Relay};

/// Most bytes the proxy records, over all connections and both directions.
pub const RECORDING_CAP_BYTES: u64 = 512 << 20;

/// How long [`FaultKind::SwapCtrl`] holds its frame back waiting for the next `CTRL`
/// frame before it forwards it anyway.
pub const SWAP_WAIT: Duration = Duration::from_secs(2);

/// What a [`Fault`] does to the frame it selects.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FaultKind {
    /// Flip the lowest bit of the middle byte of a `CTRL` frame's payload.
    FlipCtrl,
    /// Do not forward a `CTRL` frame.
    DropCtrl,
    /// Forward a `CTRL` frame twice in a row.
    ReplayCtrl,
    /// Hold a `CTRL` frame back and forward it right after the next `CTRL` frame of the
    /// same direction (other frames pass meanwhile). If none arrives within
    /// [`SWAP_WAIT`], or the sender closes first, the held frame is forwarded late but
    /// in order, and the fault does not count as fired.
    SwapCtrl,
    /// Flip the lowest bit of the middle byte of a data frame's payload: a granted
    /// `READ_RESP` (status 0) or a `WRITE_REQ`.
    FlipData,
}

/// One tampering: `kind` applied to the `nth` frame it selects (`CTRL` frames, or data
/// frames for [`FaultKind::FlipData`]; 1-based, counted per connection in
/// `direction`, the greeting not counted).
///
/// It fires once per proxy: on the first connection whose frames reach `nth`, or only
/// on the one [`Fault::on_connection`] names; after that the proxy forwards
/// everything unchanged. A flip of an empty payload is not made, and leaves the fault
/// armed for later connections.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fault {
    kind: FaultKind,
    direction: Direction,
    nth: u64,
    connection: Option<u64>,
}

impl Fault {
    /// `kind` on the `nth` selected frame going `direction`. Panics when `nth` is 0.
    pub fn new(kind: FaultKind, direction: Direction, nth: u64) -> Fault {
        assert!(nth >= 1, "frames are counted from 1");
        Fault {
            kind,
            direction,
            nth,
            connection: None,
        }
    }

    /// Applies only on connection `index` (0 for the first the proxy accepted, as in
    /// [`TamperProxy::recorded`]).
    pub fn on_connection(self, index: u64) -> Fault {
        Fault {
            connection: Some(index),
            ..self
        }
    }
}

/// A running tampering proxy: listens on the upstream's host on an ephemeral port and
/// forwards each connection to the upstream address. Dropping it closes every socket
/// and joins every thread.
#[derive(Debug)]
pub struct TamperProxy {
    relay: Relay,
    state: Arc<State>,
}

/// What the proxy's threads share besides the relay.
#[derive(Debug)]
struct State {
    fault: Option<Fault>,
    /// The fault has not fired (or been claimed by a swap) yet.
    armed: AtomicBool,
    fired: AtomicU64,
    /// One per connection, by index.
    recordings: Mutex<Vec<Arc<Recording>>>,
    recording_cap_bytes: u64,
    recorded_bytes: AtomicU64,
    truncated: AtomicBool,
}

/// What was forwarded on one connection: `[client to server, server to client]`.
#[derive(Debug, Default)]
struct Recording {
    streams: [Mutex<Vec<u8>>; 2],
}

impl Recording {
    fn stream(&self, direction: Direction) -> &Mutex<Vec<u8>> {
        match direction {
            Direction::ClientToServer => &self.streams[0],
            Direction::ServerToClient => &self.streams[1],
        }
    }
}

impl State {
    /// Appends `bytes` to `stream` unless the cap is reached (then stops for good).
    fn record(&self, stream: &Mutex<Vec<u8>>, bytes: &[u8]) {
        if self.truncated.load(Ordering::SeqCst) {
            return;
        }
        let len = bytes.len() as u64;
        let before = self.recorded_bytes.fetch_add(len, Ordering::SeqCst);
        if before + len > self.recording_cap_bytes {
            if !self.truncated.swap(true, Ordering::SeqCst) {
                eprintln!(
                    "tamper proxy: recorded {} bytes, the cap; recording stops here",
                    self.recording_cap_bytes
                );
            }
            return;
        }
        lock(stream).extend_from_slice(bytes);
    }
}

impl TamperProxy {
    /// Starts a proxy in front of `upstream` (`HOST:PORT`, e.g. [`crate::Server::addr`]),
    /// listening on the same host with an ephemeral port. `fault` `None` forwards
    /// everything unchanged (and still records).
    pub fn start(upstream: &str, fault: Option<Fault>) -> TamperProxy {
        TamperProxy::start_capped(upstream, fault, RECORDING_CAP_BYTES)
    }

    fn start_capped(upstream: &str, fault: Option<Fault>, cap_bytes: u64) -> TamperProxy {
        let state = Arc::new(State {
            fault,
            armed: AtomicBool::new(fault.is_some()),
            fired: AtomicU64::new(0),
            recordings: Mutex::new(Vec::new()),
            recording_cap_bytes: cap_bytes,
            recorded_bytes: AtomicU64::new(0),
            truncated: AtomicBool::new(false),
        });
        let relay = {
            let state = state.clone();
            Relay::start("tamper proxy", upstream, move |connection| {
                let recording = Arc::new(Recording::default());
                {
                    let mut recordings = lock(&state.recordings);
                    assert_eq!(recordings.len() as u64, connection);
                    recordings.push(recording.clone());
                }
                [Direction::ClientToServer, Direction::ServerToClient].map(|direction| {
                    Box::new(Pump {
                        direction,
                        connection,
                        state: state.clone(),
                        recording: recording.clone(),
                        ctrl_frames: 0,
                        data_frames: 0,
                        held: None,
                    }) as Box<dyn Forward>
                })
            })
        };
        TamperProxy { relay, state }
    }

    relay_accessors!();

    /// How many times the fault was applied: 0 or 1.
    pub fn fired(&self) -> u64 {
        self.state.fired.load(Ordering::SeqCst)
    }

    /// The bytes forwarded so far on connection `connection` (0 for the first
    /// accepted) going `direction`, greeting included. Panics on a connection the
    /// proxy has not accepted.
    pub fn recorded(&self, connection: u64, direction: Direction) -> Vec<u8> {
        let recording = {
            let recordings = lock(&self.state.recordings);
            usize::try_from(connection)
                .ok()
                .and_then(|i| recordings.get(i).cloned())
                .unwrap_or_else(|| {
                    panic!(
                        "no connection {connection}: the proxy accepted {}",
                        recordings.len()
                    )
                })
        };
        // A local, so the guard drops before `recording` does.
        let bytes = lock(recording.stream(direction)).clone();
        bytes
    }

    /// Every connection's stream going `direction`, concatenated in connection order.
    pub fn recorded_all(&self, direction: Direction) -> Vec<u8> {
        let recordings = lock(&self.state.recordings);
        let mut all = Vec::new();
        for recording in recordings.iter() {
            all.extend_from_slice(&lock(recording.stream(direction)));
        }
        all
    }

    /// Whether `needle` occurs in any one recorded stream (either direction, any
    /// connection; a match across two streams does not count).
    pub fn contains(&self, needle: &[u8]) -> bool {
        let finder = memmem::Finder::new(needle);
        let recordings = lock(&self.state.recordings);
        recordings.iter().any(|recording| {
            recording
                .streams
                .iter()
                .any(|stream| finder.find(&lock(stream)).is_some())
        })
    }

    /// Whether recording stopped at [`RECORDING_CAP_BYTES`].
    pub fn recording_truncated(&self) -> bool {
        self.state.truncated.load(Ordering::SeqCst)
    }
}

/// Which count a frame is in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Class {
    Ctrl,
    /// A granted `READ_RESP` or a `WRITE_REQ`.
    Data,
    Other,
}

fn class(head: Head) -> Class {
    match head {
        Head::Ctrl => Class::Ctrl,
        Head::ReadResp { status, .. } if status == STATUS_OK => Class::Data,
        Head::WriteReq => Class::Data,
        _ => Class::Other,
    }
}

/// A `CTRL` frame held back by [`FaultKind::SwapCtrl`].
struct Held {
    bytes: Vec<u8>,
    until: Instant,
}

/// Forwards and records one direction of one connection, applying the fault.
struct Pump {
    direction: Direction,
    connection: u64,
    state: Arc<State>,
    recording: Arc<Recording>,
    /// `CTRL` frames seen so far.
    ctrl_frames: u64,
    /// Data frames seen so far.
    data_frames: u64,
    held: Option<Held>,
}

impl Pump {
    /// The fault to apply to `frame` (the `nth` of its class), claimed: it is then
    /// applied by no other frame.
    fn claim(&self, frame: &Frame, class: Class, nth: u64) -> Option<FaultKind> {
        let fault = self.state.fault?;
        let (wanted, flips) = match fault.kind {
            FaultKind::FlipCtrl => (Class::Ctrl, true),
            FaultKind::DropCtrl | FaultKind::ReplayCtrl | FaultKind::SwapCtrl => {
                (Class::Ctrl, false)
            }
            FaultKind::FlipData => (Class::Data, true),
        };
        let selected = fault.direction == self.direction
            && fault.connection.is_none_or(|c| c == self.connection)
            && class == wanted
            && nth == fault.nth
            && !(flips && frame.payload().is_empty());
        let claimed = selected
            && self
                .state
                .armed
                .compare_exchange(true, false, Ordering::SeqCst, Ordering::SeqCst)
                .is_ok();
        claimed.then_some(fault.kind)
    }

    fn fire(&self) {
        self.state.fired.fetch_add(1, Ordering::SeqCst);
    }

    /// Forwards the held frame, if any, late but in order.
    fn release(&mut self, to: &mut TcpStream) -> io::Result<()> {
        match self.held.take() {
            Some(held) => self.send(to, &held.bytes),
            None => Ok(()),
        }
    }
}

impl Forward for Pump {
    fn send(&mut self, to: &mut TcpStream, bytes: &[u8]) -> io::Result<()> {
        to.write_all(bytes)?;
        self.state
            .record(self.recording.stream(self.direction), bytes);
        Ok(())
    }

    fn frame(&mut self, frame: &mut Frame, to: &mut TcpStream) -> io::Result<()> {
        let class = class(frame.head);
        let nth = match class {
            Class::Ctrl => {
                self.ctrl_frames += 1;
                self.ctrl_frames
            }
            Class::Data => {
                self.data_frames += 1;
                self.data_frames
            }
            Class::Other => 0,
        };
        match self.claim(frame, class, nth) {
            None => self.send(to, &frame.bytes)?,
            Some(FaultKind::FlipCtrl | FaultKind::FlipData) => {
                let payload = frame.payload_mut();
                payload[payload.len() / 2] ^= 0x01;
                self.send(to, &frame.bytes)?;
                self.fire();
            }
            Some(FaultKind::DropCtrl) => self.fire(),
            Some(FaultKind::ReplayCtrl) => {
                self.send(to, &frame.bytes)?;
                self.send(to, &frame.bytes)?;
                self.fire();
            }
            Some(FaultKind::SwapCtrl) => {
                self.held = Some(Held {
                    bytes: frame.bytes.clone(),
                    until: Instant::now() + SWAP_WAIT,
                });
                return Ok(());
            }
        }
        if class == Class::Ctrl && self.held.is_some() {
            self.release(to)?;
            self.fire();
        }
        Ok(())
    }

    fn deadline(&self) -> Option<Instant> {
        self.held.as_ref().map(|held| held.until)
    }

    fn idle(&mut self, to: &mut TcpStream) -> io::Result<()> {
        self.release(to)
    }

    fn end(&mut self, to: &mut TcpStream) -> io::Result<()> {
        self.release(to)
    }
}

/// What [`replay`] got back.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReplayOutcome {
    /// Bytes of the stream the server's socket took (all of them unless it closed or
    /// stopped reading first).
    pub written: usize,
    /// Everything the server sent.
    pub received: Vec<u8>,
    /// Whether the server ended the connection (a close or a reset) before the timeout.
    pub closed: bool,
}

/// Opens a fresh connection to `upstream` (`HOST:PORT`), writes `client_to_server` as
/// it is (a [`TamperProxy::recorded`] stream, greeting included) while reading what the
/// server sends, until the server ends the connection or `timeout` passes.
///
/// The replay never half-closes its side, so a server that accepts the replayed
/// session and waits for more shows as `closed: false` after the whole `timeout`.
/// Panics when `upstream` is not `HOST:PORT` or cannot be connected to.
pub fn replay(upstream: &str, client_to_server: &[u8], timeout: Duration) -> ReplayOutcome {
    let addr: SocketAddr = upstream
        .parse()
        .unwrap_or_else(|e| panic!("replay upstream {upstream:?} is not HOST:PORT: {e}"));
    let deadline = Instant::now() + timeout;
    let mut socket = TcpStream::connect_timeout(&addr, timeout)
        .unwrap_or_else(|e| panic!("replay cannot connect to {addr}: {e}"));
    socket.set_nodelay(true).expect("set the replay's nodelay");
    let receiver = socket.try_clone().expect("clone the replay socket");
    thread::scope(|scope| {
        let receiving = scope.spawn(move || receive_until(receiver, deadline));
        let written = send_until(&mut socket, client_to_server, deadline);
        let (received, closed) = receiving
            .join()
            .unwrap_or_else(|panic| std::panic::resume_unwind(panic));
        ReplayOutcome {
            written,
            received,
            closed,
        }
    })
}

/// Writes `bytes` until done, the deadline, or a failed write; returns the bytes sent.
fn send_until(socket: &mut TcpStream, bytes: &[u8], deadline: Instant) -> usize {
    let mut written = 0;
    while written < bytes.len() {
        let Some(left) = left_until(deadline) else {
            break;
        };
        if socket.set_write_timeout(Some(left)).is_err() {
            break;
        }
        match socket.write(&bytes[written..]) {
            Ok(0) => break,
            Ok(n) => written += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            // Closed, reset or not reading: the rest is not sent.
            Err(_) => break,
        }
    }
    written
}

/// Reads until the peer ends the connection (`true`) or the deadline (`false`).
fn receive_until(mut socket: TcpStream, deadline: Instant) -> (Vec<u8>, bool) {
    let mut received = Vec::new();
    let mut buf = vec![0u8; 64 << 10];
    while let Some(left) = left_until(deadline) {
        if socket.set_read_timeout(Some(left)).is_err() {
            return (received, true);
        }
        match socket.read(&mut buf) {
            Ok(0) => return (received, true),
            Ok(n) => received.extend_from_slice(&buf[..n]),
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock
                        | io::ErrorKind::TimedOut
                        | io::ErrorKind::Interrupted
                ) => {}
            Err(_) => return (received, true),
        }
    }
    (received, false)
}

#[cfg(test)]
mod tests {
    //! The proxy between two fake peers on loopback that speak the framing by hand.

    use std::net::{Shutdown, TcpListener};

    use ferry_common::transport::tcp::wire::{Header, GREETING};
    use ferry_common::transport::RemoteSlice;

    use super::*;
    use crate::{ctrl_frame, frame_bytes};

    /// Bound on every blocking step, so a broken proxy fails a test instead of hanging.
    const IO_TIMEOUT: Duration = Duration::from_secs(10);

    const C2S: Direction = Direction::ClientToServer;
    const S2C: Direction = Direction::ServerToClient;

    /// The fake upstream's listener and a proxy in front of it.
    fn proxied(fault: Option<Fault>) -> (TcpListener, TamperProxy) {
        proxied_capped(fault, RECORDING_CAP_BYTES)
    }

    fn proxied_capped(fault: Option<Fault>, cap_bytes: u64) -> (TcpListener, TamperProxy) {
        let upstream = TcpListener::bind("127.0.0.1:0").expect("bind the fake upstream");
        upstream.set_nonblocking(true).expect("non-blocking accept");
        let addr = upstream.local_addr().expect("upstream address").to_string();
        let proxy = TamperProxy::start_capped(&addr, fault, cap_bytes);
        (upstream, proxy)
    }

    fn accept(listener: &TcpListener) -> TcpStream {
        let deadline = Instant::now() + IO_TIMEOUT;
        loop {
            match listener.accept() {
                Ok((socket, _)) => {
                    socket.set_nonblocking(false).expect("blocking socket");
                    return socket;
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock && Instant::now() < deadline => {
                    thread::sleep(Duration::from_millis(5));
                }
                Err(e) => panic!("the proxy never connected upstream: {e}"),
            }
        }
    }

    /// A client connected through the proxy and the upstream's end of it.
    struct Peers {
        client: TcpStream,
        server: TcpStream,
    }

    impl Peers {
        fn connect(upstream: &TcpListener, proxy: &TamperProxy) -> Peers {
            let client = TcpStream::connect(proxy.addr()).expect("connect to the proxy");
            let server = accept(upstream);
            for s in [&client, &server] {
                s.set_read_timeout(Some(IO_TIMEOUT)).expect("read timeout");
                s.set_write_timeout(Some(IO_TIMEOUT))
                    .expect("write timeout");
            }
            Peers { client, server }
        }

        /// `(sender, receiver)` for frames going `direction`.
        fn ends(&mut self, direction: Direction) -> (&mut TcpStream, &mut TcpStream) {
            match direction {
                Direction::ClientToServer => (&mut self.client, &mut self.server),
                Direction::ServerToClient => (&mut self.server, &mut self.client),
            }
        }

        /// Sends the greeting and `frames` going `direction`, closes that direction
        /// and returns everything that arrived; the other direction stays silent.
        fn transfer(&mut self, direction: Direction, frames: &[Vec<u8>]) -> Vec<u8> {
            let (sender, receiver) = self.ends(direction);
            sender.write_all(&stream(frames)).expect("send");
            sender.shutdown(Shutdown::Write).expect("half-close");
            let mut received = Vec::new();
            receiver
                .read_to_end(&mut received)
                .expect("receive until the proxy passes the close on");
            received
        }
    }

    /// The greeting followed by `frames`.
    fn stream(frames: &[Vec<u8>]) -> Vec<u8> {
        let mut bytes = GREETING.to_vec();
        for frame in frames {
            bytes.extend_from_slice(frame);
        }
        bytes
    }

    fn ctrl(fill: u8, len: usize) -> Vec<u8> {
        ctrl_frame(&vec![fill; len])
    }

    fn read_data(id: u64, payload: &[u8]) -> Vec<u8> {
        let len = payload.len() as u32;
        frame_bytes(Header::ReadData { id, len }, payload)
    }

    fn read_refused(id: u64) -> Vec<u8> {
        frame_bytes(Header::ReadRefused { id, status: 2 }, &[])
    }

    fn read_req(id: u64, len: u32) -> Vec<u8> {
        let slice = RemoteSlice {
            rkey: 7,
            addr: 0x1000,
            len,
        };
        frame_bytes(Header::ReadReq { id, slice }, &[])
    }

    fn write_req(id: u64, payload: &[u8]) -> Vec<u8> {
        let slice = RemoteSlice {
            rkey: 9,
            addr: 0x2000,
            len: payload.len() as u32,
        };
        frame_bytes(Header::WriteReq { id, slice }, payload)
    }

    fn write_resp(id: u64) -> Vec<u8> {
        frame_bytes(Header::WriteResp { id, status: 0 }, &[])
    }

    /// The one bit in which `got` differs from `sent` (same length), as `(byte, mask)`.
    fn single_bit_flip(sent: &[u8], got: &[u8]) -> (usize, u8) {
        assert_eq!(sent.len(), got.len());
        let diffs: Vec<(usize, u8)> = sent
            .iter()
            .zip(got)
            .enumerate()
            .filter(|(_, (a, b))| a != b)
            .map(|(i, (a, b))| (i, a ^ b))
            .collect();
        assert_eq!(diffs.len(), 1, "bytes changed: {diffs:?}");
        assert_eq!(diffs[0].1.count_ones(), 1, "{diffs:?}");
        diffs[0]
    }

    #[test]
    fn without_a_fault_both_directions_are_forwarded_and_recorded_byte_for_byte() {
        let (upstream, proxy) = proxied(None);
        let mut peers = Peers::connect(&upstream, &proxy);
        let c2s = vec![ctrl(0xa1, 40), read_req(1, 5), ctrl(0xa2, 3)];
        let s2c = vec![
            ctrl(0xb1, 17),
            read_data(1, b"hello"),
            read_refused(2),
            write_req(3, b"secret-bytes"),
            write_resp(4),
            ctrl(0xb2, 0),
        ];
        assert_eq!(peers.transfer(C2S, &c2s), stream(&c2s));
        assert_eq!(peers.transfer(S2C, &s2c), stream(&s2c));
        assert_eq!(proxy.recorded(0, C2S), stream(&c2s));
        assert_eq!(proxy.recorded(0, S2C), stream(&s2c));
        assert_eq!(proxy.recorded_all(S2C), stream(&s2c));
        assert!(proxy.contains(b"secret-bytes"));
        assert!(proxy.contains(&[0xa1; 40]));
        assert!(!proxy.contains(b"not-sent"));
        assert!(!proxy.recording_truncated());
        assert_eq!(
            (proxy.connections(), proxy.fired(), proxy.parse_errors()),
            (1, 0, 0)
        );
    }

    /// Sends the greeting and `frames` through a proxy applying `fault`, on its first
    /// connection and in the fault's direction; checks that the fault fired and that
    /// the recording is what arrived, and returns what arrived.
    fn tampered(fault: Fault, frames: &[Vec<u8>]) -> Vec<u8> {
        let (upstream, proxy) = proxied(Some(fault));
        let got = Peers::connect(&upstream, &proxy).transfer(fault.direction, frames);
        assert_eq!(proxy.recorded(0, fault.direction), got);
        assert_eq!(proxy.fired(), 1);
        got
    }

    #[test]
    fn flip_ctrl_changes_one_bit_of_the_nth_control_payload() {
        let frames = vec![ctrl(1, 10), read_req(1, 4), ctrl(2, 10), ctrl(3, 10)];
        let got = tampered(Fault::new(FaultKind::FlipCtrl, C2S, 2), &frames);
        let (at, _) = single_bit_flip(&stream(&frames), &got);
        let second_payload = GREETING.len() + frames[0].len() + frames[1].len() + 5;
        assert!((second_payload..second_payload + 10).contains(&at), "{at}");
    }

    #[test]
    fn drop_ctrl_removes_the_nth_control_frame() {
        let frames = vec![ctrl(1, 4), read_data(1, b"data"), ctrl(2, 4), ctrl(3, 4)];
        let got = tampered(Fault::new(FaultKind::DropCtrl, S2C, 2), &frames);
        let kept = [frames[0].clone(), frames[1].clone(), frames[3].clone()];
        assert_eq!(got, stream(&kept));
    }

    #[test]
    fn replay_ctrl_forwards_the_nth_control_frame_twice() {
        let frames = vec![ctrl(1, 6), ctrl(2, 6)];
        let got = tampered(Fault::new(FaultKind::ReplayCtrl, C2S, 1), &frames);
        let repeated = [frames[0].clone(), frames[0].clone(), frames[1].clone()];
        assert_eq!(got, stream(&repeated));
    }

    #[test]
    fn swap_ctrl_sends_the_nth_control_frame_after_the_next_one() {
        let frames = vec![ctrl(1, 5), read_data(1, b"abc"), ctrl(2, 5), ctrl(3, 5)];
        let got = tampered(Fault::new(FaultKind::SwapCtrl, S2C, 1), &frames);
        let reordered = [
            frames[1].clone(),
            frames[2].clone(),
            frames[0].clone(),
            frames[3].clone(),
        ];
        assert_eq!(got, stream(&reordered));
    }

    #[test]
    fn flip_data_changes_one_bit_of_the_nth_data_payload() {
        let frames = vec![
            read_data(1, &[0x11; 64]),
            ctrl(1, 64),
            read_refused(2),
            write_resp(3),
            write_req(4, &[0x22; 64]),
            read_data(5, &[0x33; 64]),
        ];
        let got = tampered(Fault::new(FaultKind::FlipData, S2C, 2), &frames);
        let sent = stream(&frames);
        let (at, _) = single_bit_flip(&sent, &got);
        let write_payload = sent.len() - frames[5].len() - 64;
        assert!((write_payload..write_payload + 64).contains(&at), "{at}");
    }

    #[test]
    fn a_held_frame_goes_out_in_order_after_the_wait_or_at_the_close() {
        let fault = Fault::new(FaultKind::SwapCtrl, C2S, 1);
        let (upstream, proxy) = proxied(Some(fault));
        let mut peers = Peers::connect(&upstream, &proxy);
        let first = ctrl(1, 8);
        let start = Instant::now();
        peers
            .client
            .write_all(&stream(std::slice::from_ref(&first)))
            .unwrap();
        let mut got = vec![0u8; GREETING.len() + first.len()];
        peers.server.read_exact(&mut got).expect("the held frame");
        assert!(start.elapsed() >= SWAP_WAIT, "{:?}", start.elapsed());
        assert_eq!(got, stream(&[first]));
        // Consumed: the next frames pass in order, and nothing counts as fired.
        let (second, third) = (ctrl(2, 8), ctrl(3, 8));
        peers.client.write_all(&second).unwrap();
        peers.client.write_all(&third).unwrap();
        peers.client.shutdown(Shutdown::Write).unwrap();
        let mut rest = Vec::new();
        peers.server.read_to_end(&mut rest).unwrap();
        assert_eq!(rest, [second, third].concat());
        assert_eq!(proxy.fired(), 0);

        let fault = Fault::new(FaultKind::SwapCtrl, C2S, 2);
        let (upstream, proxy) = proxied(Some(fault));
        let mut peers = Peers::connect(&upstream, &proxy);
        let frames = vec![ctrl(1, 3), ctrl(2, 3)];
        let start = Instant::now();
        assert_eq!(peers.transfer(C2S, &frames), stream(&frames));
        assert!(start.elapsed() < SWAP_WAIT, "released at the close");
        assert_eq!(proxy.fired(), 0);
    }

    #[test]
    fn a_fault_fires_once_on_the_connection_it_names() {
        let fault = Fault::new(FaultKind::DropCtrl, C2S, 1).on_connection(1);
        let (upstream, proxy) = proxied(Some(fault));
        let frames = vec![ctrl(1, 4), ctrl(2, 4)];
        for connection in 0..3 {
            let got = Peers::connect(&upstream, &proxy).transfer(C2S, &frames);
            let expected = if connection == 1 {
                stream(&frames[1..])
            } else {
                stream(&frames)
            };
            assert_eq!(got, expected, "connection {connection}");
            assert_eq!(proxy.recorded(connection, C2S), expected);
        }
        assert_eq!(proxy.recorded_all(C2S).len(), 3 * stream(&frames).len() - 9);
        assert_eq!((proxy.connections(), proxy.fired()), (3, 1));
    }

    #[test]
    fn without_a_named_connection_the_first_that_reaches_nth_takes_the_fault() {
        let fault = Fault::new(FaultKind::ReplayCtrl, S2C, 2);
        let (upstream, proxy) = proxied(Some(fault));
        let short = vec![ctrl(1, 4)];
        let long = vec![ctrl(1, 4), ctrl(2, 4)];
        let mut first = Peers::connect(&upstream, &proxy);
        assert_eq!(first.transfer(S2C, &short), stream(&short));
        let mut second = Peers::connect(&upstream, &proxy);
        assert_eq!(
            second.transfer(S2C, &long),
            stream(&[long[0].clone(), long[1].clone(), long[1].clone()])
        );
        let mut third = Peers::connect(&upstream, &proxy);
        assert_eq!(third.transfer(S2C, &long), stream(&long));
        assert_eq!(proxy.fired(), 1);
    }

    #[test]
    fn an_unknown_frame_kind_ends_the_connection() {
        let (upstream, proxy) = proxied(None);
        let mut peers = Peers::connect(&upstream, &proxy);
        let got = peers.transfer(C2S, &[ctrl(1, 4), vec![0x07, 0, 0, 0, 0]]);
        assert_eq!(got, stream(&[ctrl(1, 4)]));
        assert_eq!(proxy.parse_errors(), 1);
        // Both sockets are shut down: the client sees the end too.
        let mut rest = Vec::new();
        peers.client.read_to_end(&mut rest).unwrap();
        assert!(rest.is_empty());
    }

    #[test]
    fn recording_stops_at_the_cap_and_forwarding_goes_on() {
        let (upstream, proxy) = proxied_capped(None, 100);
        let mut peers = Peers::connect(&upstream, &proxy);
        let frames = vec![ctrl(1, 50), ctrl(2, 100), ctrl(3, 1)];
        assert_eq!(peers.transfer(C2S, &frames), stream(&frames));
        assert_eq!(proxy.recorded(0, C2S), stream(&frames[..1]));
        assert!(proxy.recording_truncated());
    }

    /// A fake upstream that reads `expect` bytes, answers `answer`, then closes
    /// (`close`) or keeps the connection open until the client goes.
    fn fake_server(
        expect: usize,
        answer: &'static [u8],
        close: bool,
    ) -> (String, thread::JoinHandle<Vec<u8>>) {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        listener.set_nonblocking(true).unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let server = thread::spawn(move || {
            let mut socket = accept(&listener);
            socket.set_read_timeout(Some(IO_TIMEOUT)).unwrap();
            let mut got = vec![0u8; expect];
            socket.read_exact(&mut got).unwrap();
            socket.write_all(answer).unwrap();
            if !close {
                let mut rest = Vec::new();
                let _ = socket.read_to_end(&mut rest);
            }
            got
        });
        (addr, server)
    }

    #[test]
    fn replay_sends_the_stream_and_reports_the_close() {
        let sent = stream(&[ctrl(1, 30), write_req(1, b"payload")]);
        let (addr, server) = fake_server(sent.len(), b"refused", true);
        let outcome = replay(&addr, &sent, IO_TIMEOUT);
        assert_eq!(server.join().unwrap(), sent);
        assert_eq!(
            outcome,
            ReplayOutcome {
                written: sent.len(),
                received: b"refused".to_vec(),
                closed: true,
            }
        );
    }

    #[test]
    fn replay_to_a_server_that_stays_open_ends_at_the_timeout() {
        let sent = stream(&[ctrl(1, 3)]);
        let (addr, server) = fake_server(sent.len(), b"welcome", false);
        let start = Instant::now();
        let outcome = replay(&addr, &sent, Duration::from_millis(300));
        assert!(start.elapsed() >= Duration::from_millis(300));
        assert_eq!(
            (outcome.written, outcome.received.as_slice(), outcome.closed),
            (sent.len(), b"welcome".as_slice(), false)
        );
        assert_eq!(server.join().unwrap(), sent);
    }
}
