//! Connection setup with rdma_cm: [`connect`] on the client, [`Listener`] and
//! [`Incoming`] on the server.
//!
//! Both sides post all their control receives before connecting, then exchange a
//! 12-byte hello in the connection's private data:
//!
//! ```text
//! 0..4   "FRYR"
//! 4      version (1)
//! 5      0 = hello, 1 = reject (byte 6 is then the reason)
//! 6..8   receives posted for control frames, u16 LE (the peer's initial credits)
//! 8..12  bytes per receive, u32 LE
//! ```
//!
//! The transport pads private data with zeros; trailing bytes are ignored.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rdma_sys::rdma_cm_event_type as ev;
use tokio::io::unix::AsyncFd;
use tokio::sync::{mpsc, Semaphore};

use super::flow::Flow;
use super::{
    describe, driver, CtrlState, Rdma, Shared, RDMA_OPS, READ_DEPTH, RECV_SLOTS, SEND_SLOTS,
    SLOT_BYTES,
};
use crate::transport::sys::verbs::{
    CmEvent, CmId, ConnParams, Cq, EventChannel, Pd, Qp, QpCaps, Ring, Watch,
};
use crate::transport::{TransportError, MAX_QUEUED_CTRL_BYTES};

const MAGIC: &[u8; 4] = b"FRYR";
const VERSION: u8 = 1;
/// Address and route resolution timeout, per step.
const RESOLVE_MS: i32 = 2000;
/// How long a connection may take to become established once requested.
const ESTABLISH_TIMEOUT: Duration = Duration::from_secs(10);

/// Reject reasons in the reject private data.
const REJECT_VERSION: u8 = 1;

/// The control-ring geometry a side announces.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Hello {
    pub recv_slots: u16,
    pub slot_bytes: u32,
}

impl Hello {
    fn ours() -> Hello {
        Hello {
            recv_slots: RECV_SLOTS as u16,
            slot_bytes: SLOT_BYTES as u32,
        }
    }

    fn encode(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(12);
        b.extend_from_slice(MAGIC);
        b.extend_from_slice(&[VERSION, 0]);
        b.extend_from_slice(&self.recv_slots.to_le_bytes());
        b.extend_from_slice(&self.slot_bytes.to_le_bytes());
        b
    }

    fn decode(b: &[u8]) -> Result<Hello, String> {
        if b.len() < 12 || &b[0..4] != MAGIC {
            return Err("the peer is not a Ferry RDMA endpoint (bad hello)".into());
        }
        if b[4] != VERSION {
            return Err(format!(
                "the peer speaks Ferry RDMA version {}, this side {VERSION}",
                b[4]
            ));
        }
        if b[5] != 0 {
            return Err("unexpected hello kind".into());
        }
        let hello = Hello {
            recv_slots: u16::from_le_bytes([b[6], b[7]]),
            slot_bytes: u32::from_le_bytes([b[8], b[9], b[10], b[11]]),
        };
        if hello.recv_slots < 4 || hello.slot_bytes < 256 {
            return Err(format!("the peer's control ring is too small ({hello:?})"));
        }
        Ok(hello)
    }
}

fn reject_data(reason: u8) -> Vec<u8> {
    let mut b = Vec::with_capacity(12);
    b.extend_from_slice(MAGIC);
    b.extend_from_slice(&[VERSION, 1, reason, 0, 0, 0, 0, 0]);
    b
}

fn describe_reject(ev: &CmEvent) -> String {
    let p = &ev.private;
    if p.len() >= 7 && &p[0..4] == MAGIC && p[5] == 1 {
        return match p[6] {
            REJECT_VERSION => "the server refused: incompatible Ferry RDMA version".into(),
            r => format!("the server refused the connection (reason {r})"),
        };
    }
    format!(
        "connection rejected (status {}): is ferryd serving RDMA on that address and port?",
        ev.status
    )
}

/// Waits for the next rdma_cm event on `channel`.
async fn next_event(
    afd: &AsyncFd<Watch>,
    channel: &Arc<EventChannel>,
) -> Result<CmEvent, TransportError> {
    loop {
        if let Some(e) = channel.next_event()? {
            return Ok(e);
        }
        let mut ready = afd.readable().await.map_err(|source| TransportError::Io {
            op: "wait for an rdma_cm event",
            source,
        })?;
        match channel.next_event()? {
            Some(e) => return Ok(e),
            None => ready.clear_ready(),
        }
    }
}

/// The verbs objects of one connection, made before connecting.
struct Resources {
    pd: Arc<Pd>,
    cq: Arc<Cq>,
    qp: Qp,
    send_ring: Ring,
    recv_ring: Ring,
}

impl Resources {
    /// PD, CQ, QP and control rings on `id`'s device, with every receive posted.
    fn new(id: &Arc<CmId>) -> Result<Resources, TransportError> {
        let send_wr = (SEND_SLOTS + RDMA_OPS) as u32;
        let pd = Pd::new(id)?;
        let cq = Cq::new(id, (send_wr + RECV_SLOTS) as i32)?;
        let qp = Qp::new(
            id,
            &pd,
            &cq,
            QpCaps {
                send_wr,
                recv_wr: RECV_SLOTS,
            },
        )?;
        let send_ring = Ring::new(&pd, SEND_SLOTS, SLOT_BYTES)?;
        let mut recv_ring = Ring::new(&pd, RECV_SLOTS as usize, SLOT_BYTES)?;
        for slot in 0..recv_ring.slots() {
            qp.post_recv(&mut recv_ring, slot, super::wr::RECV | slot as u64)?;
        }
        Ok(Resources {
            pd,
            cq,
            qp,
            send_ring,
            recv_ring,
        })
    }

    /// Wraps the established connection and starts its driver task.
    fn start(
        self,
        channel: Arc<EventChannel>,
        id: Arc<CmId>,
        peer_hello: Hello,
        fallback: SocketAddr,
    ) -> Result<Rdma, TransportError> {
        let cm_fd = channel.watch()?;
        let cq_fd = self.cq.watch()?;
        let slot_bytes = SLOT_BYTES.min(peer_hello.slot_bytes as usize);
        let flow = Flow::new(
            RECV_SLOTS,
            u32::from(peer_hello.recv_slots),
            slot_bytes,
            crate::codec::MAX_CTRL_FRAME_BYTES,
        );
        let (peer, device) = describe(&id, fallback);
        let (ctrl_tx, ctrl_rx) = mpsc::unbounded_channel();
        let shared = Arc::new(Shared {
            qp: self.qp,
            ctrl: Mutex::new(CtrlState {
                flow,
                send_ring: self.send_ring,
                free_send: (0..SEND_SLOTS).rev().collect(),
                recv_posted: self.recv_ring.slots(),
                recv_ring: self.recv_ring,
                close_posted: false,
                peer_closed: false,
            }),
            registrations: AtomicUsize::new(0),
            copy_file_windows: AtomicBool::new(false),
            copies: Default::default(),
            pending: Mutex::new(Default::default()),
            cq: self.cq,
            pd: self.pd,
            id,
            channel,
            ops: Arc::new(Semaphore::new(RDMA_OPS)),
            ctrl_budget: Arc::new(Semaphore::new(MAX_QUEUED_CTRL_BYTES)),
            next_op: AtomicU64::new(0),
            closed: AtomicBool::new(false),
            disconnected: AtomicBool::new(false),
            ctrl_tx,
            backlog: AtomicUsize::new(0),
            peer,
            device,
        });
        tokio::spawn(driver::run(shared.clone(), cq_fd, cm_fd));
        Ok(Rdma {
            shared,
            ctrl_rx: tokio::sync::Mutex::new(ctrl_rx),
        })
    }
}

fn unavailable(e: TransportError) -> TransportError {
    TransportError::Unavailable(format!(
        "cannot open the RDMA connection manager ({e}); no RDMA device or rdma_ucm not loaded"
    ))
}

/// Connects to a Ferry RDMA endpoint at `addr` (the address of an RDMA-capable
/// interface; on RoCE, rdma_cm cannot route 127.0.0.1).
pub async fn connect(addr: SocketAddr) -> Result<Rdma, TransportError> {
    let fail = |reason: String| TransportError::Connect {
        peer: addr.to_string(),
        reason,
    };
    let channel = EventChannel::new().map_err(unavailable)?;
    let afd = channel.watch()?;
    let id = Arc::new(CmId::new(&channel)?);

    id.resolve_addr(addr, RESOLVE_MS)
        .map_err(|e| fail(e.to_string()))?;
    let e = next_event(&afd, &channel).await?;
    if e.kind != ev::RDMA_CM_EVENT_ADDR_RESOLVED {
        return Err(fail(format!(
            "no RDMA device reaches this address ({}, status {})",
            e.name(),
            e.status
        )));
    }
    id.resolve_route(RESOLVE_MS)
        .map_err(|e| fail(e.to_string()))?;
    let e = next_event(&afd, &channel).await?;
    if e.kind != ev::RDMA_CM_EVENT_ROUTE_RESOLVED {
        return Err(fail(format!(
            "no RDMA route to this address ({}, status {}); rdma_cm needs the device's \
             own address, not a loopback one",
            e.name(),
            e.status
        )));
    }

    let res = Resources::new(&id)?;
    let hello = Hello::ours().encode();
    id.connect(&ConnParams {
        private: &hello,
        initiator_depth: READ_DEPTH,
        responder_resources: READ_DEPTH,
    })?;
    let e = tokio::time::timeout(ESTABLISH_TIMEOUT, next_event(&afd, &channel))
        .await
        .map_err(|_| fail("no answer from the server".into()))??;
    match e.kind {
        ev::RDMA_CM_EVENT_ESTABLISHED => {}
        ev::RDMA_CM_EVENT_REJECTED => return Err(fail(describe_reject(&e))),
        _ => {
            return Err(fail(format!(
                "connection failed ({}, status {})",
                e.name(),
                e.status
            )))
        }
    }
    let peer_hello = Hello::decode(&e.private).map_err(fail)?;
    drop(afd);
    res.start(channel, id, peer_hello, addr)
}

/// A listening rdma_cm id.
pub struct Listener {
    // Field order: the fd watch goes before the channel that owns the fd.
    afd: AsyncFd<Watch>,
    id: CmId,
    channel: Arc<EventChannel>,
}

impl Listener {
    /// Listens on `addr` (port 0 picks one). Fails with
    /// [`TransportError::Unavailable`] where there is no RDMA.
    pub fn bind(addr: SocketAddr) -> Result<Listener, TransportError> {
        let channel = EventChannel::new().map_err(unavailable)?;
        let id = CmId::new(&channel)?;
        id.bind(addr)?;
        id.listen(128)?;
        Ok(Listener {
            afd: channel.watch()?,
            id,
            channel,
        })
    }

    /// The port listened on.
    pub fn local_port(&self) -> u16 {
        self.id.local_port()
    }

    /// Waits for the next connect request.
    pub async fn accept(&self) -> Result<Incoming, TransportError> {
        loop {
            let e = next_event(&self.afd, &self.channel).await?;
            let name = e.name();
            match (e.kind, e.new_id) {
                (ev::RDMA_CM_EVENT_CONNECT_REQUEST, Some(id)) => {
                    return Ok(Incoming {
                        id,
                        private: e.private,
                        initiator_depth: e.initiator_depth,
                        responder_resources: e.responder_resources,
                    })
                }
                (ev::RDMA_CM_EVENT_DEVICE_REMOVAL, _) => {
                    return Err(TransportError::Unavailable(
                        "the RDMA device was removed".into(),
                    ))
                }
                _ => tracing::debug!("rdma listener: ignoring {name}"),
            }
        }
    }
}

/// A connect request, not yet accepted. Dropping it rejects the request.
pub struct Incoming {
    id: CmId,
    private: Vec<u8>,
    initiator_depth: u8,
    responder_resources: u8,
}

impl Incoming {
    /// The requesting peer's address.
    pub fn peer(&self) -> String {
        self.id
            .peer_addr()
            .map(|a| a.to_string())
            .unwrap_or_else(|| "unknown peer".into())
    }

    /// Accepts the request and waits until the connection is established.
    pub async fn establish(self) -> Result<Rdma, TransportError> {
        let peer = self.peer();
        let fallback = self
            .id
            .peer_addr()
            .unwrap_or_else(|| SocketAddr::from(([0, 0, 0, 0], 0)));
        let peer_hello = match Hello::decode(&self.private) {
            Ok(h) => h,
            Err(reason) => {
                let _ = self.id.reject(&reject_data(REJECT_VERSION));
                return Err(TransportError::Protocol(format!("{peer}: {reason}")));
            }
        };
        let channel = EventChannel::new()?;
        let mut id = self.id;
        id.migrate(&channel)?;
        let id = Arc::new(id);
        let afd = channel.watch()?;
        let res = Resources::new(&id)?;
        let hello = Hello::ours().encode();
        id.accept(&ConnParams {
            private: &hello,
            initiator_depth: READ_DEPTH.min(self.responder_resources),
            responder_resources: READ_DEPTH.min(self.initiator_depth),
        })?;
        let e = tokio::time::timeout(ESTABLISH_TIMEOUT, next_event(&afd, &channel))
            .await
            .map_err(|_| TransportError::Connect {
                peer: peer.clone(),
                reason: "the client did not complete the connection".into(),
            })??;
        if e.kind != ev::RDMA_CM_EVENT_ESTABLISHED {
            return Err(TransportError::Connect {
                peer,
                reason: format!("connection failed ({}, status {})", e.name(), e.status),
            });
        }
        drop(afd);
        res.start(channel, id, peer_hello, fallback)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hello_round_trips_and_tolerates_padding() {
        let mut b = Hello::ours().encode();
        b.resize(56, 0);
        assert_eq!(Hello::decode(&b), Ok(Hello::ours()));
    }

    #[test]
    fn foreign_or_future_hellos_are_refused() {
        assert!(Hello::decode(b"HTTP/1.1 200").is_err());
        let mut b = Hello::ours().encode();
        b[4] = 9;
        assert!(Hello::decode(&b).unwrap_err().contains("version 9"));
        let mut b = Hello::ours().encode();
        b[6] = 1;
        b[7] = 0;
        assert!(Hello::decode(&b).unwrap_err().contains("too small"));
    }
}
