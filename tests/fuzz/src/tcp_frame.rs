//! `tcp_frame`: the input is what a peer sends on a tcp-transport connection after the
//! greeting, a stream of frames.

use ferry_common::transport::tcp::wire::{Header, Parsed, MAX_HEADER_BYTES};

/// Parses `data` frame by frame, as the engine's reader does, until it ends or is
/// refused. Every header is at most [`MAX_HEADER_BYTES`], encodes back to exactly the
/// bytes it came from, and every strict prefix of it asks for more bytes; a request
/// for more bytes asks for more than there are and at most [`MAX_HEADER_BYTES`].
/// Control payloads go through [`crate::codec_decode`].
pub fn tcp_frame(data: &[u8]) {
    let mut rest = data;
    loop {
        let (header, consumed) = match Header::parse(rest) {
            Ok(Parsed::Header { header, consumed }) => (header, consumed),
            Ok(Parsed::Need(n)) => {
                assert!(n > rest.len() && n <= MAX_HEADER_BYTES, "need {n}");
                return;
            }
            // The engine closes the connection here.
            Err(_) => return,
        };
        assert!(consumed > 0 && consumed <= MAX_HEADER_BYTES);
        let mut again = Vec::new();
        header.encode(&mut again);
        assert_eq!(again, rest[..consumed], "{header:?}");
        for cut in 0..consumed {
            match Header::parse(&rest[..cut]) {
                Ok(Parsed::Need(n)) => assert!(n > cut && n <= consumed, "{header:?} cut {cut}"),
                other => panic!("{header:?} cut at {cut}: {other:?}"),
            }
        }
        rest = &rest[consumed..];
        let len = header.payload_len() as usize;
        let Some(payload) = rest.get(..len) else {
            return;
        };
        if let Header::Ctrl { .. } = header {
            crate::codec_decode(payload);
        }
        rest = &rest[len..];
    }
}
