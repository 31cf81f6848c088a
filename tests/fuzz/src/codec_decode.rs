//! `codec_decode`: the input is one control message.

use ferry_common::codec::{self, CodecError, MAX_CTRL_FRAME_BYTES};

/// Decodes `data`. A message that decodes is within the limits, encodes again and
/// decodes back to an equal message; one that does not fails with a typed error.
///
/// The encoding is not canonical (postcard accepts over-long varints such as
/// `87 00` for 7), so the re-encoding may be shorter than `data`, never longer.
pub fn codec_decode(data: &[u8]) {
    match codec::decode(data) {
        Ok(msg) => {
            assert_eq!(codec::validate(&msg), Ok(()));
            let bytes = codec::encode(&msg).expect("a decoded message encodes");
            assert!(bytes.len() <= MAX_CTRL_FRAME_BYTES);
            assert!(bytes.len() <= data.len(), "re-encoding grew the message");
            assert_eq!(codec::decode(&bytes).as_ref(), Ok(&msg));
        }
        Err(
            CodecError::Truncated
            | CodecError::TrailingBytes(_)
            | CodecError::Malformed(_)
            | CodecError::Limit { .. },
        ) => {}
        Err(CodecError::FrameTooLarge(n)) => assert!(n > MAX_CTRL_FRAME_BYTES),
        Err(e) => panic!(
            "unexpected error for a frame of {} bytes: {e:?}",
            data.len()
        ),
    }
}
