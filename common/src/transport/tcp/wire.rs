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

use crate::transport::AccessFault;

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

/// Most peer-initiated READs a side serves concurrently before it treats the peer as
/// hostile and closes (an RDMA responder's `max_dest_rd_atomic`, generously).
pub const MAX_PEER_INFLIGHT_READS: usize = 1024;

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
}
