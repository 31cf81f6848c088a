//! Fuzz targets for Ferry, as plain functions of the input bytes: each
//! `fuzz_targets/NAME.rs` is a one-line libFuzzer wrapper around the function of the
//! same name here, so the logic also builds and runs without libFuzzer (the `seeds`
//! example runs every committed seed through it).
//!
//! - [`codec_decode`]: one control message, `ferry_common::codec::decode`.
//! - [`tcp_frame`]: a byte stream of tcp-transport frames, `wire::Header::parse`.
//! - [`server_session`]: [`Record`]s driving the sans-IO `ServerSession` with a
//!   simulated clock, checked against a model of the session rules.
//! - [`server_requests`]: [`Record`]s sent as requests to a real in-process ferryd over
//!   the tcp transport on loopback, against a temporary share.
//!
//! Every target asserts its invariants with `assert!`: a failed assertion or any panic
//! (in any thread: libFuzzer's panic hook aborts the process) is a crash.
//!
//! See `docs/fuzzing.md` for how to run them.
#![forbid(unsafe_code)]
#![warn(missing_docs)]

mod codec_decode;
pub mod seeds;
mod server_requests;
mod server_session;
mod tcp_frame;

pub use codec_decode::codec_decode;
pub use server_requests::server_requests;
pub use server_session::server_session;
pub use tcp_frame::tcp_frame;

/// The names of every target, in the order `scripts/fuzz.sh` runs them.
pub const TARGETS: [&str; 4] = [
    "codec_decode",
    "tcp_frame",
    "server_session",
    "server_requests",
];

/// One step of a stateful target's input: `flags u8, len u16 LE, bytes[len]`. A
/// record cut short by the end of the input keeps the bytes that are there.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Record<'a> {
    /// What to do with `bytes`; each target gives the bits their meaning.
    pub flags: u8,
    /// Usually an encoded control message.
    pub bytes: &'a [u8],
}

impl Record<'_> {
    /// Appends a record of `flags` and `bytes` (at most `u16::MAX` of them) to `out`.
    pub fn encode(flags: u8, bytes: &[u8], out: &mut Vec<u8>) {
        let len = bytes.len().min(usize::from(u16::MAX));
        out.push(flags);
        out.extend_from_slice(&(len as u16).to_le_bytes());
        out.extend_from_slice(&bytes[..len]);
    }
}

/// The records of `data`, in order.
pub fn records(mut data: &[u8]) -> impl Iterator<Item = Record<'_>> {
    std::iter::from_fn(move || {
        let (&flags, rest) = data.split_first()?;
        let (len, rest) = match rest {
            [a, b, rest @ ..] => (usize::from(u16::from_le_bytes([*a, *b])), rest),
            _ => (0, &[][..]),
        };
        let (bytes, rest) = rest.split_at(len.min(rest.len()));
        data = rest;
        Some(Record { flags, bytes })
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_round_trip_and_tolerate_short_input() {
        let mut data = Vec::new();
        Record::encode(1, b"abc", &mut data);
        Record::encode(2, b"", &mut data);
        let got: Vec<_> = records(&data).collect();
        assert_eq!(
            got,
            [
                Record {
                    flags: 1,
                    bytes: b"abc"
                },
                Record {
                    flags: 2,
                    bytes: b""
                }
            ]
        );
        let cut: Vec<_> = records(&[7, 9, 0, b'x']).collect();
        assert_eq!(
            cut,
            [Record {
                flags: 7,
                bytes: b"x"
            }]
        );
        assert_eq!(records(&[7, 1]).count(), 1);
    }
}
