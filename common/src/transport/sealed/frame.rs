//! The plaintext inside a sealed control record (all integers little-endian).
//!
//! ```text
//! APP     : 0x00 payload                                  an application message
//! PULL    : 0x01 u64 id u32 rkey u64 addr u32 len         "seal me these bytes of yours"
//! SEALED  : 0x02 u64 id u32 srkey u64 saddr u64 ctr tag[16]
//!                                                         the bytes, sealed, in scratch
//! FAULT   : 0x03 u64 id u8 fault                          a PULL or PUSH refused
//! PUSH    : 0x04 u64 id u32 srkey u64 saddr u64 ctr tag[16] u32 rkey u64 addr u32 len
//!                                                         "take these sealed bytes of
//!                                                          mine into your rkey/addr"
//! DONE    : 0x05 u64 id                                   a PUSH is in place, opened
//! RELEASE : 0x06 u64 id                                   a SEALED scratch was read
//! ALIVE   : 0x07                                          sent every few seconds
//! SEALED' : 0x08 u64 id u32 srkey u64 saddr u64 ctr tag[16] u32 gen
//! PUSH'   : 0x09 u64 id u32 srkey u64 saddr u64 ctr tag[16] u32 gen u32 rkey u64 addr
//!           u32 len                                       SEALED and PUSH with the
//!                                                         piece's key generation
//! UPDATE  : 0x0a                                          the last record under this
//!                                                         control key
//! RETIRE  : 0x0b u32 gen                                  no piece announced from now
//!                                                         on is of data key `gen`
//! ```
//!
//! `rkey/addr/len` name the application's registered memory (the wrapper's rkeys);
//! `srkey/saddr` name a scratch buffer of the inner transport that holds `len` bytes
//! of ciphertext, sealed under the sender's data key with counter `ctr`. Fault codes
//! are `transport::tcp::wire`'s status bytes. A session with key updates (capability
//! `rekey`) uses `SEALED'` and `PUSH'` and may send `UPDATE` and `RETIRE`; one
//! without uses `SEALED` and `PUSH` and sends neither.

use crate::seal::TAG_BYTES;
use crate::transport::{AccessFault, RemoteSlice};

const APP: u8 = 0x00;
const PULL: u8 = 0x01;
const SEALED: u8 = 0x02;
const FAULT: u8 = 0x03;
const PUSH: u8 = 0x04;
const DONE: u8 = 0x05;
const RELEASE: u8 = 0x06;
const ALIVE: u8 = 0x07;
const SEALED_G: u8 = 0x08;
const PUSH_G: u8 = 0x09;
const UPDATE: u8 = 0x0a;
const RETIRE: u8 = 0x0b;

/// Sealed bytes waiting in a scratch buffer of the inner transport.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Piece {
    /// The scratch bytes (inner rkey, address, length).
    pub scratch: RemoteSlice,
    /// The data-key counter they were sealed under.
    pub counter: u64,
    /// Their tag.
    pub tag: [u8; TAG_BYTES],
    /// The generation of the data key they were sealed under, in a session with key
    /// updates; `None` in one without.
    pub generation: Option<u32>,
}

/// One record's plaintext. `id` names one pull or push of the side that started it.
#[allow(missing_docs)]
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Frame {
    /// An application control message.
    App(Vec<u8>),
    /// A request to seal `src` (the receiver's memory) into scratch.
    Pull { id: u64, src: RemoteSlice },
    /// The answer to a `Pull`: the scratch holds the pull's `len` bytes (its `len` is
    /// not sent; a decoded one reads 0 until the receiver sets it).
    Sealed { id: u64, piece: Piece },
    /// A `Pull` or `Push` refused by the memory's owner.
    Fault { id: u64, fault: AccessFault },
    /// Sealed bytes to be read and opened into `dst` (the receiver's memory).
    Push {
        id: u64,
        piece: Piece,
        dst: RemoteSlice,
    },
    /// A `Push` is in place.
    Done { id: u64 },
    /// The scratch of `Sealed { id }` may be reused.
    Release { id: u64 },
    /// Nothing but the next counter: a record dropped on the way fails the next one,
    /// so this bounds how long a drop goes unnoticed on an idle connection.
    Alive,
    /// The sender's next record is sealed under its next control key.
    Update,
    /// The sender announces no more pieces of data key `generation`.
    Retire { generation: u32 },
}

fn put_slice(out: &mut Vec<u8>, s: &RemoteSlice) {
    out.extend_from_slice(&s.rkey.to_le_bytes());
    out.extend_from_slice(&s.addr.to_le_bytes());
    out.extend_from_slice(&s.len.to_le_bytes());
}

fn put_piece(out: &mut Vec<u8>, p: &Piece) {
    out.extend_from_slice(&p.scratch.rkey.to_le_bytes());
    out.extend_from_slice(&p.scratch.addr.to_le_bytes());
    out.extend_from_slice(&p.counter.to_le_bytes());
    out.extend_from_slice(&p.tag);
    if let Some(g) = p.generation {
        out.extend_from_slice(&g.to_le_bytes());
    }
}

/// The kind byte of a piece-carrying frame: `plain` without a generation, `with`
/// with one.
fn kind_of(p: &Piece, plain: u8, with: u8) -> u8 {
    if p.generation.is_some() {
        with
    } else {
        plain
    }
}

impl Frame {
    /// The record's plaintext.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(64);
        match self {
            Frame::App(payload) => {
                out.reserve(payload.len());
                out.push(APP);
                out.extend_from_slice(payload);
            }
            Frame::Pull { id, src } => {
                out.push(PULL);
                out.extend_from_slice(&id.to_le_bytes());
                put_slice(&mut out, src);
            }
            Frame::Sealed { id, piece } => {
                out.push(kind_of(piece, SEALED, SEALED_G));
                out.extend_from_slice(&id.to_le_bytes());
                put_piece(&mut out, piece);
            }
            Frame::Fault { id, fault } => {
                out.push(FAULT);
                out.extend_from_slice(&id.to_le_bytes());
                out.push(crate::transport::tcp::wire::status_of(*fault));
            }
            Frame::Push { id, piece, dst } => {
                out.push(kind_of(piece, PUSH, PUSH_G));
                out.extend_from_slice(&id.to_le_bytes());
                put_piece(&mut out, piece);
                put_slice(&mut out, dst);
            }
            Frame::Done { id } => {
                out.push(DONE);
                out.extend_from_slice(&id.to_le_bytes());
            }
            Frame::Release { id } => {
                out.push(RELEASE);
                out.extend_from_slice(&id.to_le_bytes());
            }
            Frame::Alive => out.push(ALIVE),
            Frame::Update => out.push(UPDATE),
            Frame::Retire { generation } => {
                out.push(RETIRE);
                out.extend_from_slice(&generation.to_le_bytes());
            }
        }
        out
    }

    /// Parses a record's plaintext; `None` if it is malformed (which, in a record
    /// that authenticated, only a broken peer sends).
    pub fn decode(mut bytes: Vec<u8>) -> Option<Frame> {
        let kind = *bytes.first()?;
        if kind == APP {
            bytes.remove(0);
            return Some(Frame::App(bytes));
        }
        let mut r = Reader { bytes: &bytes[1..] };
        let frame = match kind {
            PULL => Frame::Pull {
                id: r.u64()?,
                src: r.slice()?,
            },
            SEALED | SEALED_G => {
                let id = r.u64()?;
                let (rkey, addr, counter, tag) = r.piece_head()?;
                let generation = r.generation(kind == SEALED_G)?;
                // The length is the pull's; the receiver fills it in.
                let scratch = RemoteSlice { rkey, addr, len: 0 };
                Frame::Sealed {
                    id,
                    piece: Piece {
                        scratch,
                        counter,
                        tag,
                        generation,
                    },
                }
            }
            FAULT => Frame::Fault {
                id: r.u64()?,
                fault: crate::transport::tcp::wire::fault_of(r.u8()?)?,
            },
            PUSH | PUSH_G => {
                let id = r.u64()?;
                let (rkey, addr, counter, tag) = r.piece_head()?;
                let generation = r.generation(kind == PUSH_G)?;
                let dst = r.slice()?;
                let piece = Piece {
                    scratch: RemoteSlice {
                        rkey,
                        addr,
                        len: dst.len,
                    },
                    counter,
                    tag,
                    generation,
                };
                Frame::Push { id, piece, dst }
            }
            DONE => Frame::Done { id: r.u64()? },
            RELEASE => Frame::Release { id: r.u64()? },
            ALIVE => Frame::Alive,
            UPDATE => Frame::Update,
            RETIRE => Frame::Retire {
                generation: r.u32()?,
            },
            _ => return None,
        };
        r.bytes.is_empty().then_some(frame)
    }
}

struct Reader<'a> {
    bytes: &'a [u8],
}

impl Reader<'_> {
    fn take<const N: usize>(&mut self) -> Option<[u8; N]> {
        let (head, rest) = self.bytes.split_first_chunk::<N>()?;
        self.bytes = rest;
        Some(*head)
    }
    fn u8(&mut self) -> Option<u8> {
        self.take::<1>().map(|b| b[0])
    }
    fn u32(&mut self) -> Option<u32> {
        self.take().map(u32::from_le_bytes)
    }
    fn u64(&mut self) -> Option<u64> {
        self.take().map(u64::from_le_bytes)
    }
    fn slice(&mut self) -> Option<RemoteSlice> {
        Some(RemoteSlice {
            rkey: self.u32()?,
            addr: self.u64()?,
            len: self.u32()?,
        })
    }
    fn piece_head(&mut self) -> Option<(u32, u64, u64, [u8; TAG_BYTES])> {
        Some((self.u32()?, self.u64()?, self.u64()?, self.take()?))
    }
    /// A piece's generation if the frame kind carries one (`Some(None)` if not).
    fn generation(&mut self, carried: bool) -> Option<Option<u32>> {
        if carried {
            self.u32().map(Some)
        } else {
            Some(None)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_frame_round_trips_and_garbage_is_refused() {
        let slice = RemoteSlice {
            rkey: 7,
            addr: 0x1000,
            len: 4096,
        };
        let piece = Piece {
            scratch: RemoteSlice {
                rkey: 9,
                addr: 0x2000,
                len: 0,
            },
            counter: 5,
            tag: [3; 16],
            generation: None,
        };
        let with_generation = Piece {
            generation: Some(0x0102_0304),
            ..piece
        };
        let frames = [
            Frame::App(b"hello".to_vec()),
            Frame::App(Vec::new()),
            Frame::Pull { id: 1, src: slice },
            Frame::Sealed { id: 2, piece },
            Frame::Fault {
                id: 3,
                fault: AccessFault::OutOfBounds,
            },
            Frame::Push {
                id: 4,
                piece: Piece {
                    scratch: RemoteSlice {
                        len: 4096,
                        ..piece.scratch
                    },
                    ..piece
                },
                dst: slice,
            },
            Frame::Done { id: 5 },
            Frame::Release { id: 6 },
            Frame::Alive,
            Frame::Sealed {
                id: 7,
                piece: with_generation,
            },
            Frame::Push {
                id: 8,
                piece: Piece {
                    scratch: RemoteSlice {
                        len: 4096,
                        ..piece.scratch
                    },
                    ..with_generation
                },
                dst: slice,
            },
            Frame::Update,
            Frame::Retire { generation: 9 },
        ];
        for f in frames {
            let bytes = f.encode();
            assert_eq!(Frame::decode(bytes.clone()), Some(f.clone()), "{f:?}");
            if !matches!(f, Frame::App(_)) {
                let mut long = bytes.clone();
                long.push(0);
                assert_eq!(Frame::decode(long), None);
                assert_eq!(Frame::decode(bytes[..bytes.len() - 1].to_vec()), None);
            }
        }
        assert_eq!(Frame::decode(vec![0x7f, 1, 2]), None);
        assert_eq!(Frame::decode(Vec::new()), None);
    }
}
