//! Control messages over SEND/RECV: fragmentation and credit-based flow control, with
//! no I/O (the connection driver feeds it completions and posts what it returns).
//!
//! Every SEND lands in a receive buffer the peer posted beforehand; a SEND with no
//! posted receive would be an RNR NAK, which the QPs are set up to treat as fatal. As in
//! RPC-over-RDMA (RFC 8166 §3.3), the receiver grants credits and the sender never has
//! more SENDs in flight than it was granted:
//!
//! - Each side posts `N` receives up front (told to the peer at connection time) and
//!   re-posts each one as soon as its bytes are copied out.
//! - Every frame carries the sender's *grant*: the cumulative number of receives it has
//!   made available (`N` plus every receive re-posted so far, wrapping `u32`). The
//!   peer may have `grant - sent` more SENDs outstanding.
//! - While the application has [`Flow::set_hold`] on (too many received messages not yet
//!   taken), the grant stops growing: back-pressure on the peer without dropping.
//! - A frame with payload needs two credits: the last one is kept for a credit-only
//!   frame, sent when at least half the receives are re-posted but not yet advertised.
//!   Because every frame advertises everything re-posted, a side that is out of credits
//!   always has a peer that owes it at least `N - 1` and can still send a credit-only
//!   frame: no deadlock (the simulation test below checks this). With `N >= 4` the
//!   threshold `N / 2` is at least 2, so a credit-only frame (which costs the peer one
//!   receive) never by itself triggers another one: no credit ping-pong.
//!
//! Frame layout (little-endian), at most one receive slot long:
//!
//! ```text
//! 0..4   grant   u32  cumulative receives posted by the sender
//! 4      flags   u8   1 = MORE (another fragment of this message follows),
//!                     2 = CREDIT (credit-only, no payload), 4 = CLOSE (orderly end)
//! 5..8   zero
//! 8..    payload      a fragment of one control message
//! ```

use std::collections::VecDeque;

/// Bytes of the frame header.
pub const HEADER_BYTES: usize = 8;

const MORE: u8 = 1;
const CREDIT: u8 = 2;
const CLOSE: u8 = 4;

/// A frame the peer sent that breaks the rules above.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FlowError {
    /// Shorter than the header.
    #[error("control frame of {0} bytes is shorter than its header")]
    Short(usize),
    /// Unknown flag bits or non-zero reserved bytes.
    #[error("control frame header has unknown flags {0:#04x} or reserved bytes set")]
    BadHeader(u8),
    /// The grant went backwards.
    #[error("peer's credit grant went backwards ({old} -> {new})")]
    GrantBackwards {
        /// Previous grant.
        old: u32,
        /// New grant.
        new: u32,
    },
    /// The peer granted more receives than can exist.
    #[error("peer granted {0} credits beyond what it could have posted")]
    GrantTooLarge(u32),
    /// A credit-only frame with a payload.
    #[error("credit-only control frame carries a payload")]
    CreditWithPayload,
    /// A reassembled message is over the limit.
    #[error("control message larger than {0} bytes")]
    TooLarge(usize),
    /// A frame arrived after the peer's CLOSE.
    #[error("control frame after the peer closed")]
    AfterClose,
}

/// What a received frame amounts to.
#[derive(Debug, PartialEq, Eq)]
pub enum Received {
    /// Credits or a fragment; nothing for the application yet.
    Nothing,
    /// A complete control message.
    Message(Vec<u8>),
    /// The peer closed in order; no more messages follow.
    Closed,
}

/// One side's flow-control and fragmentation state.
#[derive(Debug)]
pub struct Flow {
    /// Payload bytes per frame.
    frag: usize,
    /// Largest reassembled message accepted.
    max_message: usize,
    /// Receives posted up front (`N`), on this side and (`peer_initial`) on the peer.
    initial: u32,
    peer_initial: u32,
    /// Cumulative receives the peer has granted us.
    peer_grant: u32,
    /// Cumulative SENDs we have handed out.
    sent: u32,
    /// Frames waiting for credits, in order: (flags, payload).
    out: VecDeque<(u8, Vec<u8>)>,
    /// Payload bytes in `out`.
    queued_bytes: usize,
    /// Cumulative receives we have posted.
    posted: u32,
    /// The last grant we put in a frame.
    advertised: u32,
    hold: bool,
    reassembly: Vec<u8>,
    peer_closed: bool,
}

impl Flow {
    /// State for a connection where this side posted `initial` receives of
    /// `slot_bytes` each and the peer posted `peer_initial`; messages up to
    /// `max_message` bytes.
    pub fn new(initial: u32, peer_initial: u32, slot_bytes: usize, max_message: usize) -> Flow {
        assert!(
            slot_bytes > HEADER_BYTES,
            "receive slots must hold a header"
        );
        assert!(
            initial >= 4 && peer_initial >= 4,
            "flow control needs four receives a side"
        );
        Flow {
            frag: slot_bytes - HEADER_BYTES,
            max_message,
            initial,
            peer_initial,
            peer_grant: peer_initial,
            sent: 0,
            out: VecDeque::new(),
            queued_bytes: 0,
            posted: initial,
            advertised: initial,
            hold: false,
            reassembly: Vec::new(),
            peer_closed: false,
        }
    }

    /// Queues one message, split into frames.
    pub fn push_message(&mut self, msg: &[u8]) {
        self.queued_bytes += msg.len();
        if msg.is_empty() {
            self.out.push_back((0, Vec::new()));
            return;
        }
        let mut pieces = msg.chunks(self.frag).peekable();
        while let Some(piece) = pieces.next() {
            let flags = if pieces.peek().is_some() { MORE } else { 0 };
            self.out.push_back((flags, piece.to_vec()));
        }
    }

    /// Queues an orderly close after every queued message.
    pub fn push_close(&mut self) {
        self.out.push_back((CLOSE, Vec::new()));
    }

    /// Frames waiting for credits.
    pub fn queued(&self) -> usize {
        self.out.len()
    }

    /// Message bytes waiting for credits (the sum of the lengths of the messages
    /// pushed, less what [`Flow::next_frame`] has handed out).
    pub fn queued_bytes(&self) -> usize {
        self.queued_bytes
    }

    /// SENDs we may still post.
    pub fn credits(&self) -> u32 {
        self.peer_grant.wrapping_sub(self.sent)
    }

    /// Receives re-posted but not yet advertised (none while held).
    pub fn owed(&self) -> u32 {
        if self.hold {
            0
        } else {
            self.posted.wrapping_sub(self.advertised)
        }
    }

    fn grant(&self) -> u32 {
        if self.hold {
            self.advertised
        } else {
            self.posted
        }
    }

    /// Stops (`true`) or resumes granting credits for re-posted receives.
    pub fn set_hold(&mut self, hold: bool) {
        self.hold = hold;
    }

    /// The next frame to SEND now, header included, or `None` if nothing may be sent
    /// (no frame queued, or not enough credits, and no credit update due).
    pub fn next_frame(&mut self) -> Option<Vec<u8>> {
        let credits = self.credits();
        let (flags, payload) = match self.out.front() {
            // CLOSE needs no reply and ends our sending: like a credit update, it may
            // use the last credit.
            Some((flags, _)) if credits >= 2 || (*flags == CLOSE && credits >= 1) => {
                let (flags, payload) = self.out.pop_front().expect("front exists");
                self.queued_bytes -= payload.len();
                (flags, payload)
            }
            _ if credits >= 1 && self.owed() >= self.initial / 2 => (CREDIT, Vec::new()),
            _ => return None,
        };
        let grant = self.grant();
        self.advertised = grant;
        self.sent = self.sent.wrapping_add(1);
        let mut frame = Vec::with_capacity(HEADER_BYTES + payload.len());
        frame.extend_from_slice(&grant.to_le_bytes());
        frame.extend_from_slice(&[flags, 0, 0, 0]);
        frame.extend_from_slice(&payload);
        Some(frame)
    }

    /// Counts a receive re-posted after its frame was taken.
    pub fn on_reposted(&mut self) {
        self.posted = self.posted.wrapping_add(1);
    }

    /// Takes one received frame.
    pub fn on_frame(&mut self, frame: &[u8]) -> Result<Received, FlowError> {
        if frame.len() < HEADER_BYTES {
            return Err(FlowError::Short(frame.len()));
        }
        if self.peer_closed {
            return Err(FlowError::AfterClose);
        }
        let grant = u32::from_le_bytes(frame[0..4].try_into().expect("4 bytes"));
        let flags = frame[4];
        if flags & !(MORE | CREDIT | CLOSE) != 0 || frame[5..8] != [0, 0, 0] {
            return Err(FlowError::BadHeader(flags));
        }
        let gained = grant.wrapping_sub(self.peer_grant);
        if gained > u32::MAX / 2 {
            return Err(FlowError::GrantBackwards {
                old: self.peer_grant,
                new: grant,
            });
        }
        // The peer can have posted at most its initial receives plus one re-post per
        // frame we sent.
        let ceiling = self.peer_initial.wrapping_add(self.sent);
        if ceiling.wrapping_sub(grant) > u32::MAX / 2 {
            return Err(FlowError::GrantTooLarge(grant.wrapping_sub(ceiling)));
        }
        self.peer_grant = grant;
        let payload = &frame[HEADER_BYTES..];
        if flags & CREDIT != 0 {
            if !payload.is_empty() {
                return Err(FlowError::CreditWithPayload);
            }
            return Ok(Received::Nothing);
        }
        if flags & CLOSE != 0 {
            self.peer_closed = true;
            return Ok(Received::Closed);
        }
        if self.reassembly.len() + payload.len() > self.max_message {
            return Err(FlowError::TooLarge(self.max_message));
        }
        self.reassembly.extend_from_slice(payload);
        if flags & MORE != 0 {
            return Ok(Received::Nothing);
        }
        Ok(Received::Message(std::mem::take(&mut self.reassembly)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    const SLOT: usize = 64;

    fn pair(n: u32) -> (Flow, Flow) {
        (Flow::new(n, n, SLOT, 10_000), Flow::new(n, n, SLOT, 10_000))
    }

    fn deliver(to: &mut Flow, frame: &[u8]) -> Received {
        let r = to.on_frame(frame).unwrap();
        to.on_reposted();
        r
    }

    #[test]
    fn a_message_is_fragmented_and_reassembled() {
        let (mut a, mut b) = pair(8);
        let msg: Vec<u8> = (0..200u8).collect();
        a.push_message(&msg);
        let mut got = None;
        while let Some(f) = a.next_frame() {
            assert!(f.len() <= SLOT);
            if let Received::Message(m) = deliver(&mut b, &f) {
                got = Some(m);
            }
        }
        assert_eq!(got.as_deref(), Some(&msg[..]));
    }

    #[test]
    fn sending_stops_at_the_reserve_credit_and_resumes_on_a_grant() {
        let (mut a, mut b) = pair(4);
        for i in 0..10u8 {
            a.push_message(&[i]);
        }
        let mut frames = Vec::new();
        while let Some(f) = a.next_frame() {
            frames.push(f);
        }
        // Four credits: three data frames, one kept for a credit update.
        assert_eq!(frames.len(), 3);
        assert_eq!(a.credits(), 1);
        assert_eq!(
            a.queued_bytes(),
            7,
            "seven one-byte messages wait for credits"
        );
        for f in &frames {
            deliver(&mut b, f);
        }
        // b owes 3 >= 4/2: it sends a credit-only frame with no message of its own.
        let update = b.next_frame().expect("credit update due");
        assert_eq!(update[4], CREDIT);
        assert_eq!(deliver(&mut a, &update), Received::Nothing);
        assert_eq!(a.credits(), 4);
    }

    #[test]
    fn hold_stops_granting() {
        let (mut a, mut b) = pair(4);
        for i in 0..3u8 {
            a.push_message(&[i]);
        }
        b.set_hold(true);
        while let Some(f) = a.next_frame() {
            deliver(&mut b, &f);
        }
        assert_eq!(b.next_frame(), None, "nothing granted while held");
        b.set_hold(false);
        assert!(b.next_frame().is_some());
    }

    #[test]
    fn hostile_frames_are_refused() {
        let (_, mut b) = pair(4);
        assert_eq!(b.on_frame(&[0; 3]), Err(FlowError::Short(3)));
        assert!(matches!(
            b.on_frame(&[4, 0, 0, 0, 0x80, 0, 0, 0]),
            Err(FlowError::BadHeader(0x80))
        ));
        assert!(matches!(
            b.on_frame(&[4, 0, 0, 0, 0, 1, 0, 0]),
            Err(FlowError::BadHeader(0))
        ));
        assert!(matches!(
            b.on_frame(&[3, 0, 0, 0, 0, 0, 0, 0]),
            Err(FlowError::GrantBackwards { .. })
        ));
        assert!(matches!(
            b.on_frame(&[100, 0, 0, 0, 0, 0, 0, 0]),
            Err(FlowError::GrantTooLarge(_))
        ));
        assert_eq!(
            b.on_frame(&[4, 0, 0, 0, CREDIT, 0, 0, 0, 9]),
            Err(FlowError::CreditWithPayload)
        );
        let mut big = vec![4, 0, 0, 0, MORE, 0, 0, 0];
        big.extend_from_slice(&[0; SLOT - HEADER_BYTES]);
        let mut small = Flow::new(4, 4, SLOT, 100);
        assert_eq!(small.on_frame(&big), Ok(Received::Nothing));
        assert_eq!(small.on_frame(&big), Err(FlowError::TooLarge(100)));
        let mut c = Flow::new(4, 4, SLOT, 100);
        assert_eq!(
            c.on_frame(&[4, 0, 0, 0, CLOSE, 0, 0, 0]),
            Ok(Received::Closed)
        );
        assert_eq!(
            c.on_frame(&[4, 0, 0, 0, 0, 0, 0, 0]),
            Err(FlowError::AfterClose)
        );
    }

    /// One simulated side: its flow state, frames in flight towards it, frames it has
    /// received but not re-posted, and delivered messages not yet taken by the app.
    struct Side {
        flow: Flow,
        wire_in: VecDeque<Vec<u8>>,
        unreposted: u32,
        app_queue: VecDeque<Vec<u8>>,
        got: Vec<Vec<u8>>,
        sent_msgs: Vec<Vec<u8>>,
        posted_free: u32,
    }

    const HOLD_AT: usize = 3;

    /// Random interleavings of sends, deliveries, re-posts and app reads on both sides:
    /// a SEND never finds the peer without a posted receive, and once everyone stops
    /// producing, everything is delivered in order (no credit deadlock).
    #[test]
    fn random_schedules_never_overrun_and_never_deadlock() {
        for seed in 0..300u64 {
            let mut rng = StdRng::seed_from_u64(seed);
            let n = rng.gen_range(4..10u32);
            let mk = |n| Side {
                flow: Flow::new(n, n, SLOT, 10_000),
                wire_in: VecDeque::new(),
                unreposted: 0,
                app_queue: VecDeque::new(),
                got: Vec::new(),
                sent_msgs: Vec::new(),
                posted_free: n,
            };
            let mut sides = [mk(n), mk(n)];
            let produce_steps = rng.gen_range(10..400);
            let mut step = 0;
            loop {
                step += 1;
                assert!(step < 200_000, "seed {seed}: no progress (deadlock)");
                let producing = step < produce_steps;
                let i = rng.gen_range(0..2);
                let (me, peer) = if i == 0 {
                    let (a, b) = sides.split_at_mut(1);
                    (&mut a[0], &mut b[0])
                } else {
                    let (a, b) = sides.split_at_mut(1);
                    (&mut b[0], &mut a[0])
                };
                match rng.gen_range(0..5) {
                    0 if producing => {
                        let len = rng.gen_range(0..200);
                        let msg: Vec<u8> = (0..len).map(|_| rng.gen()).collect();
                        me.flow.push_message(&msg);
                        me.sent_msgs.push(msg);
                    }
                    1 => {
                        if let Some(f) = me.flow.next_frame() {
                            assert!(
                                peer.posted_free > 0,
                                "seed {seed}: SEND without a posted receive (RNR)"
                            );
                            peer.posted_free -= 1;
                            peer.wire_in.push_back(f);
                        }
                    }
                    2 => {
                        if let Some(f) = me.wire_in.pop_front() {
                            match me.flow.on_frame(&f).unwrap() {
                                Received::Message(m) => me.app_queue.push_back(m),
                                Received::Nothing => {}
                                Received::Closed => unreachable!(),
                            }
                            me.unreposted += 1;
                            me.flow.set_hold(me.app_queue.len() >= HOLD_AT);
                        }
                    }
                    3 => {
                        if me.unreposted > 0 {
                            me.unreposted -= 1;
                            me.posted_free += 1;
                            me.flow.on_reposted();
                        }
                    }
                    _ => {
                        if let Some(m) = me.app_queue.pop_front() {
                            me.got.push(m);
                            me.flow.set_hold(me.app_queue.len() >= HOLD_AT);
                        }
                    }
                }
                for s in &sides {
                    let waiting: usize = s.flow.out.iter().map(|(_, p)| p.len()).sum();
                    assert_eq!(s.flow.queued_bytes(), waiting, "seed {seed}");
                }
                let quiet = sides.iter().all(|s| {
                    s.flow.queued() == 0
                        && s.wire_in.is_empty()
                        && s.unreposted == 0
                        && s.app_queue.is_empty()
                });
                if !producing && quiet {
                    break;
                }
            }
            assert_eq!(sides[0].got, sides[1].sent_msgs, "seed {seed}");
            assert_eq!(sides[1].got, sides[0].sent_msgs, "seed {seed}");
        }
    }
}
