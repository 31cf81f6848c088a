//! Frame layout of the TCP transport (all integers little-endian). See
//! `docs/protocol.md` for the table.
//!
//! ```text
//! greeting   : "FRYTCP" u16 version          (each side, once, at connect)
//! CTRL       : 0x01 u32 len  payload[len]     (len <= MAX_CTRL_FRAME_BYTES)
//! READ_REQ   : 0x02 u64 id u32 rkey u64 addr u32 len
//! READ_RESP  : 0x03 u64 id u8 status [u32 len payload[len] if status == 0]
//!              status: 0 ok, 1 invalid rkey, 2 out of bounds, 3 denied, 4 unreadable
//! WRITE_REQ  : 0x04 u64 id u32 rkey u64 addr u32 len payload[len]
//! WRITE_RESP : 0x05 u64 id u8 status
//! ```
//!
//! [`Header::parse`] and [`Header::encode`] handle the fixed part of a frame (every
//! byte before its payload) without doing any I/O: the engine reads exactly as many
//! bytes as the parser asks for, so parsing is testable, and fuzzed
//! (`tests/fuzz/fuzz_targets/tcp_frame.rs`), on byte slices.

use crate::codec::MAX_CTRL_FRAME_BYTES;
use crate::transport::{AccessFault, RemoteSlice, TransportError};

/// Greeting each side sends first.
pub const GREETING: [u8; 8] = *b"FRYTCP\x00\x01";

/// Frame kind: control message.
pub const CTRL: u8 = 0x01;
/// Frame kind: one-sided read request.
pub const READ_REQ: u8 = 0x02;
/// Frame kind: read response with data.
pub const READ_RESP: u8 = 0x03;
/// Frame kind: one-sided write request with data.
pub const WRITE_REQ: u8 = 0x04;
/// Frame kind: write acknowledgement.
pub const WRITE_RESP: u8 = 0x05;

/// Status byte: success.
pub const STATUS_OK: u8 = 0;

/// Status byte: the access was granted but the memory could not be read (a registered
/// file window whose file was truncated below it). Reported as
/// [`AccessFault::Refused`]; the connection goes on.
pub const STATUS_UNREADABLE: u8 = 4;

/// Most peer-initiated READs and WRITEs a side holds accepted but not yet answered on
/// the socket before it treats the peer as hostile and closes: an RDMA responder's
/// `max_dest_rd_atomic`, generously, and a bound on the answers a peer that does not
/// read them can make this side queue.
pub const MAX_PEER_INFLIGHT_OPS: usize = 1024;

/// Status byte for a refused access.
pub fn status_of(fault: AccessFault) -> u8 {
    match fault {
        AccessFault::InvalidRkey => 1,
        AccessFault::OutOfBounds => 2,
        AccessFault::Denied => 3,
        // The table never refuses this way (it knows the precise cause); the engine
        // sends it when granted memory cannot be read.
        AccessFault::Refused => STATUS_UNREADABLE,
    }
}

/// The refusal named by a status byte, `None` for an unknown one.
pub fn fault_of(status: u8) -> Option<AccessFault> {
    match status {
        1 => Some(AccessFault::InvalidRkey),
        2 => Some(AccessFault::OutOfBounds),
        3 => Some(AccessFault::Denied),
        STATUS_UNREADABLE => Some(AccessFault::Refused),
        _ => None,
    }
}

/// Longest fixed part of a frame: a WRITE_REQ's kind, id, rkey, addr and len.
pub const MAX_HEADER_BYTES: usize = 1 + 8 + 4 + 8 + 4;

/// The fixed part of a frame; [`Header::payload_len`] bytes of payload follow it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Header {
    /// A control message of `len` bytes (at most [`MAX_CTRL_FRAME_BYTES`]).
    Ctrl {
        /// Payload length.
        len: u32,
    },
    /// "Copy `slice` of your memory to me."
    ReadReq {
        /// The operation's id, echoed in the response.
        id: u64,
        /// What to read.
        slice: RemoteSlice,
    },
    /// A granted READ: `len` bytes of data follow.
    ReadData {
        /// The READ's id.
        id: u64,
        /// Payload length; must equal the READ's.
        len: u32,
    },
    /// A refused READ: no data follows.
    ReadRefused {
        /// The READ's id.
        id: u64,
        /// Why, as a status byte; never [`STATUS_OK`] (that would be [`Header::ReadData`]).
        status: u8,
    },
    /// "Store these `slice.len` bytes into `slice` of your memory."
    WriteReq {
        /// The operation's id, echoed in the response.
        id: u64,
        /// Where to write.
        slice: RemoteSlice,
    },
    /// The answer to a WRITE.
    WriteResp {
        /// The WRITE's id.
        id: u64,
        /// [`STATUS_OK`] or why it was refused.
        status: u8,
    },
}

/// What [`Header::parse`] made of the bytes so far.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Parsed {
    /// A whole header, `consumed` bytes long.
    Header {
        /// The header.
        header: Header,
        /// Its length in bytes (at most [`MAX_HEADER_BYTES`]).
        consumed: usize,
    },
    /// The header is longer: at least this many bytes in all (more than were given,
    /// at most [`MAX_HEADER_BYTES`]).
    Need(usize),
}

/// Why parsing stopped before a whole header.
enum Stop {
    /// The header needs this many bytes in all.
    Need(usize),
    /// The bytes are not a valid header.
    Invalid(TransportError),
}

/// A little-endian cursor over a header's bytes.
struct Cursor<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl Cursor<'_> {
    fn take<const N: usize>(&mut self) -> Result<[u8; N], Stop> {
        let end = self.at + N;
        let src = self.bytes.get(self.at..end).ok_or(Stop::Need(end))?;
        let mut out = [0; N];
        out.copy_from_slice(src);
        self.at = end;
        Ok(out)
    }

    fn u8(&mut self) -> Result<u8, Stop> {
        self.take::<1>().map(|[b]| b)
    }

    fn u32(&mut self) -> Result<u32, Stop> {
        self.take().map(u32::from_le_bytes)
    }

    fn u64(&mut self) -> Result<u64, Stop> {
        self.take().map(u64::from_le_bytes)
    }

    fn slice(&mut self) -> Result<RemoteSlice, Stop> {
        Ok(RemoteSlice {
            rkey: self.u32()?,
            addr: self.u64()?,
            len: self.u32()?,
        })
    }
}

impl Header {
    /// Parses the header at the start of `bytes`. Fails, as the engine closes the
    /// connection, on an unknown frame kind or a control frame over
    /// [`MAX_CTRL_FRAME_BYTES`]; never looks at bytes beyond the header.
    pub fn parse(bytes: &[u8]) -> Result<Parsed, TransportError> {
        let mut c = Cursor { bytes, at: 0 };
        match Header::parse_fields(&mut c) {
            Ok(header) => Ok(Parsed::Header {
                header,
                consumed: c.at,
            }),
            Err(Stop::Need(n)) => Ok(Parsed::Need(n)),
            Err(Stop::Invalid(e)) => Err(e),
        }
    }

    fn parse_fields(c: &mut Cursor<'_>) -> Result<Header, Stop> {
        Ok(match c.u8()? {
            CTRL => {
                let len = c.u32()?;
                if len as usize > MAX_CTRL_FRAME_BYTES {
                    return Err(Stop::Invalid(TransportError::Protocol(format!(
                        "control frame of {len} bytes exceeds {MAX_CTRL_FRAME_BYTES}"
                    ))));
                }
                Header::Ctrl { len }
            }
            READ_REQ => Header::ReadReq {
                id: c.u64()?,
                slice: c.slice()?,
            },
            READ_RESP => {
                let id = c.u64()?;
                match c.u8()? {
                    STATUS_OK => Header::ReadData { id, len: c.u32()? },
                    status => Header::ReadRefused { id, status },
                }
            }
            WRITE_REQ => Header::WriteReq {
                id: c.u64()?,
                slice: c.slice()?,
            },
            WRITE_RESP => Header::WriteResp {
                id: c.u64()?,
                status: c.u8()?,
            },
            other => {
                return Err(Stop::Invalid(TransportError::Protocol(format!(
                    "unknown frame kind {other:#04x}"
                ))))
            }
        })
    }

    /// Bytes of payload that follow this header.
    pub fn payload_len(&self) -> u32 {
        match *self {
            Header::Ctrl { len } | Header::ReadData { len, .. } => len,
            Header::WriteReq { slice, .. } => slice.len,
            Header::ReadReq { .. } | Header::ReadRefused { .. } | Header::WriteResp { .. } => 0,
        }
    }

    /// Appends the header's bytes to `out`; [`Header::parse`] reads them back.
    pub fn encode(&self, out: &mut Vec<u8>) {
        let slice = |out: &mut Vec<u8>, s: &RemoteSlice| {
            out.extend_from_slice(&s.rkey.to_le_bytes());
            out.extend_from_slice(&s.addr.to_le_bytes());
            out.extend_from_slice(&s.len.to_le_bytes());
        };
        match self {
            Header::Ctrl { len } => {
                out.push(CTRL);
                out.extend_from_slice(&len.to_le_bytes());
            }
            Header::ReadReq { id, slice: s } => {
                out.push(READ_REQ);
                out.extend_from_slice(&id.to_le_bytes());
                slice(out, s);
            }
            Header::ReadData { id, len } => {
                out.push(READ_RESP);
                out.extend_from_slice(&id.to_le_bytes());
                out.push(STATUS_OK);
                out.extend_from_slice(&len.to_le_bytes());
            }
            Header::ReadRefused { id, status } => {
                out.push(READ_RESP);
                out.extend_from_slice(&id.to_le_bytes());
                out.push(*status);
            }
            Header::WriteReq { id, slice: s } => {
                out.push(WRITE_REQ);
                out.extend_from_slice(&id.to_le_bytes());
                slice(out, s);
            }
            Header::WriteResp { id, status } => {
                out.push(WRITE_RESP);
                out.extend_from_slice(&id.to_le_bytes());
                out.push(*status);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statuses_round_trip() {
        for f in [
            AccessFault::InvalidRkey,
            AccessFault::OutOfBounds,
            AccessFault::Denied,
            AccessFault::Refused,
        ] {
            assert_eq!(fault_of(status_of(f)), Some(f));
        }
        assert_eq!(fault_of(STATUS_OK), None);
        assert_eq!(fault_of(200), None);
    }

    fn all_kinds() -> Vec<Header> {
        let slice = RemoteSlice {
            rkey: 0x0403_0201,
            addr: u64::MAX - 1,
            len: 17,
        };
        vec![
            Header::Ctrl { len: 0 },
            Header::Ctrl {
                len: MAX_CTRL_FRAME_BYTES as u32,
            },
            Header::ReadReq { id: 1, slice },
            Header::ReadData { id: 2, len: 17 },
            Header::ReadRefused { id: 3, status: 1 },
            Header::ReadRefused {
                id: 3,
                status: STATUS_UNREADABLE,
            },
            Header::WriteReq { id: 4, slice },
            Header::WriteResp { id: 5, status: 0 },
            Header::WriteResp { id: 6, status: 3 },
        ]
    }

    #[test]
    fn headers_round_trip_and_every_prefix_asks_for_more() {
        for h in all_kinds() {
            let mut bytes = Vec::new();
            h.encode(&mut bytes);
            assert!(bytes.len() <= MAX_HEADER_BYTES);
            // Trailing payload bytes are not the parser's business.
            let mut with_payload = bytes.clone();
            with_payload.extend_from_slice(&[0xee; 8]);
            assert_eq!(
                Header::parse(&with_payload).unwrap(),
                Parsed::Header {
                    header: h,
                    consumed: bytes.len()
                }
            );
            for cut in 0..bytes.len() {
                match Header::parse(&bytes[..cut]).unwrap() {
                    Parsed::Need(n) => assert!(n > cut && n <= bytes.len(), "{h:?} cut {cut}"),
                    other => panic!("{h:?} cut {cut}: {other:?}"),
                }
            }
        }
    }

    #[test]
    fn header_bytes_match_the_documented_layout() {
        let mut b = Vec::new();
        Header::Ctrl { len: 0x0102 }.encode(&mut b);
        assert_eq!(b, [CTRL, 0x02, 0x01, 0, 0]);
        b.clear();
        Header::ReadData { id: 9, len: 5 }.encode(&mut b);
        assert_eq!(
            b,
            [READ_RESP, 9, 0, 0, 0, 0, 0, 0, 0, STATUS_OK, 5, 0, 0, 0]
        );
        b.clear();
        Header::ReadRefused { id: 9, status: 2 }.encode(&mut b);
        assert_eq!(b, [READ_RESP, 9, 0, 0, 0, 0, 0, 0, 0, 2]);
    }

    #[test]
    fn bad_headers_are_refused() {
        for kind in [0u8, 6, 0xff] {
            assert!(matches!(
                Header::parse(&[kind]),
                Err(TransportError::Protocol(_))
            ));
        }
        let too_long = (MAX_CTRL_FRAME_BYTES as u32 + 1).to_le_bytes();
        let frame = [CTRL, too_long[0], too_long[1], too_long[2], too_long[3]];
        assert!(matches!(
            Header::parse(&frame),
            Err(TransportError::Protocol(_))
        ));
        assert_eq!(Header::parse(&[]).unwrap(), Parsed::Need(1));
    }
}
