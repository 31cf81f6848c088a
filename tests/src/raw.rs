//! A hand-written client of the TCP transport: it writes frames byte by byte (or
//! sends any bytes it is given) and reads ferryd's frames one at a time, so a test can
//! send what a well-behaved client never would and see exactly what ferryd answers.
//!
//! It also plays the part of a NIC, minimally: memory offered with
//! [`RawClient::offer`] is served to ferryd's READs (bounds-checked); every other READ
//! or WRITE of ferryd is refused with status 1 (invalid rkey). Sessions start in
//! [`crate::raw_handshake`].

use std::collections::HashMap;
use std::io::{self, Read, Write};
use std::net::{Shutdown, TcpStream};
use std::time::{Duration, Instant};

use ferry_common::codec;
use ferry_common::msg::{Message, RegionDesc, Request, Response};
use ferry_common::transport::tcp::wire::{Header, Parsed, MAX_HEADER_BYTES};
use ferry_common::transport::RemoteSlice;

/// How long a raw client waits for ferryd to answer, or to close.
pub const RAW_TIMEOUT: Duration = Duration::from_secs(10);

/// Largest frame payload a raw client accepts from ferryd (a READ answer of a whole
/// mapped window is at most 256 MiB).
const MAX_PAYLOAD_BYTES: u32 = 256 << 20;

/// Status byte of a refused access for an unknown rkey (`docs/protocol.md` section 1).
pub const STATUS_INVALID_RKEY: u8 = 1;
/// Status byte of a refused access outside the registered region.
pub const STATUS_OUT_OF_BOUNDS: u8 = 2;
/// Status byte of a refused access the region's rights do not permit.
pub const STATUS_DENIED: u8 = 3;

/// One frame from ferryd, payload included.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Frame {
    /// A control message.
    Ctrl(Message),
    /// ferryd reads our memory.
    ReadReq {
        /// Operation id.
        id: u64,
        /// What it reads.
        slice: RemoteSlice,
    },
    /// A granted READ of ferryd's memory.
    ReadData {
        /// The READ's id.
        id: u64,
        /// The bytes.
        data: Vec<u8>,
    },
    /// A refused READ of ferryd's memory.
    ReadRefused {
        /// The READ's id.
        id: u64,
        /// Why (status byte, never 0).
        status: u8,
    },
    /// ferryd writes into our memory.
    WriteReq {
        /// Operation id.
        id: u64,
        /// Where.
        slice: RemoteSlice,
        /// The bytes.
        data: Vec<u8>,
    },
    /// The answer to a WRITE of ours.
    WriteResp {
        /// The WRITE's id.
        id: u64,
        /// 0 or why it was refused.
        status: u8,
    },
}

/// How a connection that ferryd was expected to close ended.
#[derive(Debug)]
pub struct Closed {
    /// Frames ferryd sent before closing (its READs and WRITEs included, unanswered).
    pub frames: Vec<Frame>,
    /// The error the stream ended with (a reset), or `None` for a clean end of stream.
    pub error: Option<io::Error>,
}

/// A raw TCP-transport connection to ferryd (greeted; see [`crate::raw_greet`] and
/// [`crate::raw_handshake`]).
pub struct RawClient {
    stream: TcpStream,
    next_request: u64,
    next_op: u64,
    /// Memory ferryd may READ: rkey -> (addr, bytes).
    offered: HashMap<u32, (u64, Vec<u8>)>,
}

/// The bytes of a frame: `header`, then `payload`.
pub fn frame_bytes(header: Header, payload: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(MAX_HEADER_BYTES + payload.len());
    header.encode(&mut out);
    out.extend_from_slice(payload);
    out
}

/// The bytes of a control frame carrying `body` as is (valid or not).
pub fn ctrl_frame(body: &[u8]) -> Vec<u8> {
    let len = u32::try_from(body.len()).expect("a control body under 4 GiB");
    frame_bytes(Header::Ctrl { len }, body)
}

/// The bytes of a control frame carrying `msg`.
pub fn msg_frame(msg: &Message) -> Vec<u8> {
    ctrl_frame(&codec::encode(msg).expect("encodable message"))
}

impl RawClient {
    /// Wraps a stream whose greetings were exchanged.
    pub(crate) fn new(stream: TcpStream) -> RawClient {
        RawClient {
            stream,
            next_request: 1,
            next_op: 1,
            offered: HashMap::new(),
        }
    }

    /// The socket, for what the methods do not cover.
    pub fn stream(&mut self) -> &mut TcpStream {
        &mut self.stream
    }

    /// The socket, to go on with by hand.
    pub fn into_stream(self) -> TcpStream {
        self.stream
    }

    /// This side's address (ferryd logs it as the peer).
    pub fn local_addr(&self) -> String {
        self.stream.local_addr().unwrap().to_string()
    }

    /// Sends `bytes` as they are. Fails if ferryd has already closed the connection.
    pub fn send_bytes(&mut self, bytes: &[u8]) -> io::Result<()> {
        self.stream.write_all(bytes)
    }

    /// Sends `msg` in a control frame.
    pub fn send(&mut self, msg: &Message) {
        self.send_bytes(&msg_frame(msg))
            .unwrap_or_else(|e| panic!("cannot send {msg:?}: {e}"));
    }

    /// Sends `body` as a request with a fresh id; returns the id.
    pub fn request(&mut self, body: Request) -> u64 {
        let id = self.next_request;
        self.next_request += 1;
        self.send(&Message::Request { id, body });
        id
    }

    /// Sends a READ of ferryd's memory; returns the operation id.
    pub fn read(&mut self, slice: RemoteSlice) -> u64 {
        let id = self.next_op();
        self.send_bytes(&frame_bytes(Header::ReadReq { id, slice }, &[]))
            .unwrap();
        id
    }

    /// Sends a WRITE of `data` into ferryd's memory at `rkey`/`addr`; returns the id.
    pub fn write(&mut self, rkey: u32, addr: u64, data: &[u8]) -> u64 {
        let id = self.next_op();
        let slice = RemoteSlice {
            rkey,
            addr,
            len: u32::try_from(data.len()).unwrap(),
        };
        self.send_bytes(&frame_bytes(Header::WriteReq { id, slice }, data))
            .unwrap();
        id
    }

    fn next_op(&mut self) -> u64 {
        let id = self.next_op;
        self.next_op += 1;
        id
    }

    /// Makes `data` readable by ferryd under a fresh rkey; returns its descriptor.
    pub fn offer(&mut self, data: Vec<u8>) -> RegionDesc {
        let rkey = 0x5151_0000 + self.offered.len() as u32;
        let addr = 0x10_0000_0000 * (u64::from(rkey) - 0x5151_0000 + 1);
        let len = data.len() as u64;
        self.offered.insert(rkey, (addr, data));
        RegionDesc { addr, len, rkey }
    }

    /// Receives the next frame; `Ok(None)` at a clean end of stream. Panics on a
    /// frame that does not parse (ferryd broke the framing).
    pub fn recv_frame(&mut self) -> io::Result<Option<Frame>> {
        let mut head = [0u8; MAX_HEADER_BYTES];
        let mut filled = 0;
        let header = loop {
            match Header::parse(&head[..filled]).expect("ferryd sent a bad frame header") {
                Parsed::Header { header, .. } => break header,
                Parsed::Need(need) => {
                    let got = self.stream.read(&mut head[filled..need])?;
                    if got == 0 {
                        if filled == 0 {
                            return Ok(None);
                        }
                        return Err(io::ErrorKind::UnexpectedEof.into());
                    }
                    filled += got;
                }
            }
        };
        let len = header.payload_len();
        assert!(len <= MAX_PAYLOAD_BYTES, "frame payload of {len} bytes");
        let mut payload = vec![0u8; len as usize];
        self.stream.read_exact(&mut payload)?;
        Ok(Some(match header {
            Header::Ctrl { .. } => Frame::Ctrl(
                codec::decode(&payload).unwrap_or_else(|e| panic!("ferryd sent garbage: {e}")),
            ),
            Header::ReadReq { id, slice } => Frame::ReadReq { id, slice },
            Header::ReadData { id, .. } => Frame::ReadData { id, data: payload },
            Header::ReadRefused { id, status } => Frame::ReadRefused { id, status },
            Header::WriteReq { id, slice } => Frame::WriteReq {
                id,
                slice,
                data: payload,
            },
            Header::WriteResp { id, status } => Frame::WriteResp { id, status },
        }))
    }

    /// Receives the next frame that is not one of ferryd's own READs or WRITEs
    /// (those are answered on the way); panics if the connection ends first.
    pub fn recv(&mut self) -> Frame {
        loop {
            let frame = self
                .recv_frame()
                .unwrap_or_else(|e| panic!("connection to ferryd failed: {e}"))
                .expect("ferryd closed the connection");
            match self.answer(&frame) {
                Some(answer) => self.send_bytes(&answer).unwrap(),
                None => return frame,
            }
        }
    }

    /// The answer to ferryd's READ or WRITE; `None` if `frame` is neither.
    fn answer(&self, frame: &Frame) -> Option<Vec<u8>> {
        Some(match frame {
            Frame::ReadReq { id, slice } => {
                let granted = self.offered.get(&slice.rkey).and_then(|(addr, data)| {
                    let start = usize::try_from(slice.addr.checked_sub(*addr)?).ok()?;
                    data.get(start..start.checked_add(slice.len as usize)?)
                });
                match granted {
                    Some(bytes) => frame_bytes(
                        Header::ReadData {
                            id: *id,
                            len: slice.len,
                        },
                        bytes,
                    ),
                    None => frame_bytes(
                        Header::ReadRefused {
                            id: *id,
                            status: STATUS_INVALID_RKEY,
                        },
                        &[],
                    ),
                }
            }
            Frame::WriteReq { id, .. } => frame_bytes(
                Header::WriteResp {
                    id: *id,
                    status: STATUS_INVALID_RKEY,
                },
                &[],
            ),
            _ => return None,
        })
    }

    /// Receives the next control message; panics on anything else.
    pub fn recv_msg(&mut self) -> Message {
        match self.recv() {
            Frame::Ctrl(msg) => msg,
            other => panic!("expected a control message, got {other:?}"),
        }
    }

    /// Sends `body` and waits for its response, answering ferryd's READs and WRITEs
    /// meanwhile. Panics on any other frame.
    pub fn call(&mut self, body: Request) -> Response {
        let id = self.request(body);
        match self.recv_msg() {
            Message::Response { id: got, body } if got == id => body,
            other => panic!("expected the response to request {id}, got {other:?}"),
        }
    }

    /// Half-closes the sending side: ferryd sees the end of the stream.
    pub fn shutdown_write(&mut self) {
        // Ignored: ferryd may have reset the connection already.
        let _ = self.stream.shutdown(Shutdown::Write);
    }

    /// Reads until ferryd closes the connection, which it must do within
    /// [`RAW_TIMEOUT`]; ferryd's READs and WRITEs are not answered, only collected with
    /// the other frames. Panics if the connection is still open by then.
    pub fn expect_closed(mut self) -> Closed {
        let start = Instant::now();
        let mut frames = Vec::new();
        loop {
            match self.recv_frame() {
                Ok(Some(frame)) => frames.push(frame),
                Ok(None) => {
                    return Closed {
                        frames,
                        error: None,
                    }
                }
                Err(e)
                    if matches!(
                        e.kind(),
                        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                    ) =>
                {
                    panic!(
                        "ferryd did not close the connection within {:?} (frames: {frames:?})",
                        start.elapsed()
                    )
                }
                Err(e) => {
                    return Closed {
                        frames,
                        error: Some(e),
                    }
                }
            }
        }
    }
}
