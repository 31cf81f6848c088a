//! `rdma`: the verbs transport — rdma_cm connections, RC queue pairs, RDMA READ/WRITE
//! work requests against registered memory, and control messages as SEND/RECV.
//!
//! One connection is one RC QP with its own protection domain, completion queue and
//! completion channel. The PD is per connection rather than shared by every connection
//! on the device so that an rkey of one client's connection is useless on every other
//! connection — the same isolation the TCP transport's per-connection table gives (see
//! `docs/design.md`).
//!
//! - [`connect`] and [`Listener`] set connections up with rdma_cm, exchanging the
//!   control-ring geometry in the private data.
//! - One driver task per connection ([`driver`]) waits on the completion channel's fd
//!   and the connection's rdma_cm channel fd through tokio's `AsyncFd` — no thread
//!   spins — and dispatches completions: control frames to [`flow`], RDMA READ/WRITE
//!   results to the waiting callers.
//! - [`Transport::read`] / [`Transport::write`] post one signalled work request each.
//!   At most [`RDMA_OPS`] are outstanding per connection; each holds its local region
//!   (and, for a buffer, the buffer's lock) until its completion is polled, so an MR is
//!   never deregistered under a work request.
//! - Control messages are fragmented into [`SLOT_BYTES`] SENDs under credit-based flow
//!   control ([`flow`]), so a SEND never meets a receive-not-ready. At most
//!   [`MAX_QUEUED_CTRL_BYTES`](crate::transport::MAX_QUEUED_CTRL_BYTES) of messages
//!   wait for credits; beyond that [`Transport::send`] waits, so a peer that withholds
//!   credits (its application does not read) cannot grow this side's queue.
//!
//! Only `transport::sys::verbs` calls into the C libraries; this module drives its safe
//! wrappers.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};

use async_trait::async_trait;
use tokio::sync::{mpsc, oneshot, OwnedSemaphorePermit, Semaphore};

use crate::msg::RegionDesc;
use crate::transport::sys::mem::FileWindow;
use crate::transport::sys::verbs::{self, CmId, Cq, EventChannel, Mr, Pd, Qp, RdmaOp, Ring};
use crate::transport::Access;
use crate::transport::{
    AccessFault, Memory, Op, Registration, RemoteSlice, Transport, TransportError, TransportKind,
};

mod copies;
mod driver;
pub mod flow;
mod setup;

pub use setup::{connect, Incoming, Listener};

use flow::Flow;

/// Receives each side keeps posted for control frames (its initial credits).
pub const RECV_SLOTS: u32 = 32;
/// Control frames that may be in flight from one side at once.
pub const SEND_SLOTS: usize = 16;
/// Bytes of one control frame (header included).
pub const SLOT_BYTES: usize = 16 * 1024;
/// RDMA READ/WRITE work requests outstanding per connection.
pub const RDMA_OPS: usize = 64;
/// RDMA READs one side may have outstanding against the other (initiator depth and
/// responder resources).
pub const READ_DEPTH: u8 = 16;
/// Complete control messages waiting for the application before credits are withheld.
const CTRL_BACKLOG: usize = 256;

/// Names of this machine's RDMA devices (empty: no RDMA here).
pub fn devices() -> Vec<String> {
    verbs::device_names()
}

/// Checks that RDMA can be used here: a device exists and the kernel's connection
/// manager answers. The error says which part is missing.
pub fn available() -> Result<Vec<String>, TransportError> {
    let devices = devices();
    if devices.is_empty() {
        return Err(TransportError::Unavailable(
            "no RDMA device (ibv_get_device_list found none)".into(),
        ));
    }
    EventChannel::new().map_err(|e| {
        TransportError::Unavailable(format!(
            "the RDMA connection manager is missing ({e}; is rdma_ucm loaded?)"
        ))
    })?;
    Ok(devices)
}

/// Work request ids: the top two bits say what the low bits index.
mod wr {
    pub const RECV: u64 = 1 << 62;
    pub const SEND: u64 = 2 << 62;
    pub const RDMA: u64 = 3 << 62;
    pub const MASK: u64 = (1 << 62) - 1;
}

/// A control-channel event for [`Transport::recv`].
enum Ctrl {
    Message(Vec<u8>),
    /// The peer closed in order.
    End,
    /// The connection failed.
    Failed(TransportError),
}

/// An RDMA READ/WRITE waiting for its completion.
struct Pending {
    op: Op,
    slice: RemoteSlice,
    done: oneshot::Sender<Result<(), TransportError>>,
    _permit: OwnedSemaphorePermit,
}

/// SEND/RECV state, under one lock.
struct CtrlState {
    flow: Flow,
    send_ring: Ring,
    free_send: Vec<usize>,
    recv_ring: Ring,
    /// Receives currently posted.
    recv_posted: usize,
    /// Our CLOSE frame is posted; disconnect once the send queue drains.
    close_posted: bool,
    /// The peer's CLOSE arrived.
    peer_closed: bool,
}

/// Connection state shared by the handle and the driver task.
///
/// Field order is drop order: the QP goes first (the device stops touching memory),
/// then the rings and registrations, then CQ, PD and cm id.
struct Shared {
    qp: Qp,
    ctrl: Mutex<CtrlState>,
    /// Live registrations (for leak checks).
    registrations: AtomicUsize,
    /// File windows are registered as copies (set after the kernel refused to pin a
    /// file mapping: Linux < 6.2).
    copy_file_windows: AtomicBool,
    /// Buffers for those copies.
    copies: copies::WindowCopies,
    pending: Mutex<HashMap<u64, Pending>>,
    cq: Arc<Cq>,
    pd: Arc<Pd>,
    id: Arc<CmId>,
    channel: Arc<EventChannel>,
    ops: Arc<Semaphore>,
    /// Permits for the message bytes waiting in the flow's queue: a sender takes its
    /// message's length, [`Shared::pump`] gives back what it posts. Closed with the
    /// connection, failing waiting senders.
    ctrl_budget: Arc<Semaphore>,
    next_op: AtomicU64,
    /// No new work may start (closing, disconnected or failed).
    closed: AtomicBool,
    /// `rdma_disconnect` was called.
    disconnected: AtomicBool,
    ctrl_tx: mpsc::UnboundedSender<Ctrl>,
    /// Messages delivered to `ctrl_tx` and not yet taken by `recv`.
    backlog: AtomicUsize,
    peer: String,
    device: String,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // Critical sections are short map/flag updates; poisoning cannot leave them torn.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Shared {
    /// Posts as many queued control frames as credits and send slots allow, and gives
    /// the bytes posted back to the senders' budget.
    fn pump(&self, st: &mut CtrlState) -> Result<(), TransportError> {
        let queued = st.flow.queued_bytes();
        let posted = self.post_frames(st);
        self.ctrl_budget
            .add_permits(queued - st.flow.queued_bytes());
        posted
    }

    /// Posts frames while there are credits and free send slots.
    fn post_frames(&self, st: &mut CtrlState) -> Result<(), TransportError> {
        while let Some(slot) = st.free_send.last().copied() {
            let Some(frame) = st.flow.next_frame() else {
                break;
            };
            st.free_send.pop();
            let len = st.send_ring.fill(slot, &[&frame])?;
            let is_close = frame[4] & 4 != 0;
            self.qp
                .post_send(&mut st.send_ring, slot, len, wr::SEND | slot as u64)?;
            if is_close {
                st.close_posted = true;
            }
        }
        Ok(())
    }

    /// Starts an orderly disconnect once (QP to error; everything posted flushes).
    fn disconnect(&self) {
        self.closed.store(true, Ordering::SeqCst);
        self.ctrl_budget.close();
        if !self.disconnected.swap(true, Ordering::SeqCst) {
            self.id.disconnect();
        }
    }

    /// Fails the connection with `e`: the application's `recv` sees it, new work is
    /// refused and the QP is disconnected.
    fn fail(&self, e: TransportError) {
        if !self.closed.swap(true, Ordering::SeqCst) || !self.disconnected.load(Ordering::SeqCst) {
            tracing::debug!(peer = %self.peer, "rdma connection failed: {e}");
        }
        let _ = self.ctrl_tx.send(Ctrl::Failed(e));
        self.disconnect();
    }

    fn mr_of(&self, reg: &Registration) -> Result<Arc<Mr>, TransportError> {
        reg.backend::<Revoke>()
            .filter(|r| std::ptr::eq(r.shared.as_ptr(), self))
            .map(|r| r.mr.clone())
            .ok_or(TransportError::Local(
                "registration does not belong to this connection",
            ))
    }

    async fn one_sided(
        &self,
        op: Op,
        mr: Arc<Mr>,
        offset: usize,
        slice: RemoteSlice,
        guard: Option<Box<dyn std::any::Any + Send + Sync>>,
    ) -> Result<(), TransportError> {
        let permit = self
            .ops
            .clone()
            .acquire_owned()
            .await
            .map_err(|_| TransportError::Closed)?;
        if self.closed.load(Ordering::SeqCst) {
            return Err(TransportError::Closed);
        }
        let seq = self.next_op.fetch_add(1, Ordering::Relaxed) & wr::MASK;
        let (done, wait) = oneshot::channel();
        lock(&self.pending).insert(
            seq,
            Pending {
                op,
                slice,
                done,
                _permit: permit,
            },
        );
        let kind = match op {
            Op::Read => RdmaOp::Read,
            Op::Write => RdmaOp::Write,
        };
        if let Err(e) = self
            .qp
            .post_rdma(kind, wr::RDMA | seq, &mr, offset, slice, guard)
        {
            lock(&self.pending).remove(&seq);
            return Err(e);
        }
        wait.await.map_err(|_| TransportError::Closed)?
    }
}

/// Revokes an rkey when its [`Registration`] drops: with the last `Arc` the MR is
/// deregistered — unless a work request still holds it, in which case deregistration
/// waits for that completion.
struct Revoke {
    shared: Weak<Shared>,
    mr: Arc<Mr>,
}

impl Drop for Revoke {
    fn drop(&mut self) {
        if let Some(s) = self.shared.upgrade() {
            s.registrations.fetch_sub(1, Ordering::SeqCst);
        }
    }
}

/// A verbs connection to a peer.
pub struct Rdma {
    shared: Arc<Shared>,
    ctrl_rx: tokio::sync::Mutex<mpsc::UnboundedReceiver<Ctrl>>,
}

impl Rdma {
    /// The RDMA device the connection runs on (e.g. `rxe0`).
    pub fn device(&self) -> &str {
        &self.shared.device
    }

    /// Live registrations on this connection (for leak checks).
    pub fn registrations(&self) -> usize {
        self.shared.registrations.load(Ordering::SeqCst)
    }

    /// RDMA READ/WRITE work requests not yet completed.
    pub fn outstanding(&self) -> usize {
        self.shared.qp.outstanding()
    }
}

/// How long a connection dropped right after [`Transport::close`] waits for its last
/// messages and CLOSE frame to be delivered before it hangs up regardless.
const CLOSE_LINGER: std::time::Duration = std::time::Duration::from_secs(2);

impl Drop for Rdma {
    fn drop(&mut self) {
        // The driver task finishes the teardown once everything posted has flushed.
        // After `close`, it hangs up by itself once the CLOSE frame was delivered
        // (`driver::on_send`); disconnecting here at once would flush the last messages
        // (an error answer before the server closes, say) before the device sent them,
        // and the peer would see a bare disconnect instead. So a closed connection
        // lingers, bounded by CLOSE_LINGER.
        let closing = self.shared.closed.load(Ordering::SeqCst)
            && !self.shared.disconnected.load(Ordering::SeqCst);
        match tokio::runtime::Handle::try_current() {
            Ok(rt) if closing => {
                // Weak: a connection whose driver hung up already is freed at once.
                let shared = Arc::downgrade(&self.shared);
                rt.spawn(async move {
                    tokio::time::sleep(CLOSE_LINGER).await;
                    if let Some(shared) = shared.upgrade() {
                        shared.disconnect();
                    }
                });
            }
            _ => self.shared.disconnect(),
        }
    }
}

impl Rdma {
    /// Registers a copy of `window` (a pooled anonymous buffer) in its place.
    fn register_copy(
        &self,
        window: &FileWindow,
        access: Access,
    ) -> Result<(Memory, Arc<Mr>), TransportError> {
        let copy = Memory::Buffer(self.shared.copies.copy_of(window).map_err(|source| {
            TransportError::Io {
                op: "copy a file window for registration",
                source,
            }
        })?);
        let mr = Mr::register(&self.shared.pd, copy.clone(), access).map_err(memlock_hint)?;
        Ok((copy, mr))
    }
}

#[async_trait]
impl Transport for Rdma {
    fn kind(&self) -> TransportKind {
        TransportKind::Rdma
    }

    fn peer(&self) -> String {
        self.shared.peer.clone()
    }

    fn device(&self) -> Option<String> {
        Some(self.shared.device.clone())
    }

    fn register(&self, memory: Memory, access: Access) -> Result<Registration, TransportError> {
        let copy_files = self.shared.copy_file_windows.load(Ordering::Relaxed);
        let (memory, mr) = match &memory {
            Memory::File(window) if copy_files => self.register_copy(window, access)?,
            _ => match Mr::register(&self.shared.pd, memory.clone(), access) {
                Ok(mr) => (memory, mr),
                Err(TransportError::Io { source, .. })
                    if source.raw_os_error() == Some(nix::libc::EFAULT) =>
                {
                    // Linux < 6.2 pins every registration for writing, which a shared
                    // read-only file mapping refuses: from now on this connection
                    // registers copies of file windows (see `copies`).
                    let Memory::File(window) = &memory else {
                        return Err(TransportError::Io {
                            op: "ibv_reg_mr",
                            source,
                        });
                    };
                    self.shared.copy_file_windows.store(true, Ordering::Relaxed);
                    tracing::debug!(
                        "file mappings cannot be pinned here (Linux < 6.2); registering copies"
                    );
                    self.register_copy(window, access)?
                }
                Err(e) => return Err(memlock_hint(e)),
            },
        };
        let rkey = mr.rkey();
        let desc = RegionDesc {
            addr: memory.addr(),
            len: memory.len() as u64,
            rkey,
        };
        self.shared.registrations.fetch_add(1, Ordering::SeqCst);
        let revoke = Revoke {
            shared: Arc::downgrade(&self.shared),
            mr,
        };
        Ok(Registration::new(desc, memory, access, Box::new(revoke)))
    }

    async fn read(
        &self,
        src: RemoteSlice,
        dst: &Registration,
        dst_offset: usize,
    ) -> Result<(), TransportError> {
        let buf = dst.read_destination(dst_offset, src.len)?;
        let mr = self.shared.mr_of(dst)?;
        // The device writes the buffer: hold its lock until the completion is polled.
        let guard = buf.write_owned().await;
        self.shared
            .one_sided(Op::Read, mr, dst_offset, src, Some(Box::new(guard)))
            .await
    }

    async fn write(
        &self,
        src: &Registration,
        src_offset: usize,
        dst: RemoteSlice,
    ) -> Result<(), TransportError> {
        src.check_write_source(src_offset, dst.len)?;
        let mr = self.shared.mr_of(src)?;
        // The device reads the buffer: keep it from changing until the completion.
        let guard: Option<Box<dyn std::any::Any + Send + Sync>> = match src.buffer() {
            Some(b) => Some(Box::new(b.read_owned().await)),
            None => None,
        };
        self.shared
            .one_sided(Op::Write, mr, src_offset, dst, guard)
            .await
    }

    async fn send(&self, msg: Vec<u8>) -> Result<(), TransportError> {
        if msg.len() > crate::codec::MAX_CTRL_FRAME_BYTES {
            return Err(TransportError::Local("control message too large"));
        }
        if self.shared.closed.load(Ordering::SeqCst) {
            return Err(TransportError::Closed);
        }
        // Waits while MAX_QUEUED_CTRL_BYTES wait for credits (a message is at most
        // MAX_CTRL_FRAME_BYTES, which is less, so one always fits eventually).
        let budget = self
            .shared
            .ctrl_budget
            .clone()
            .acquire_many_owned(msg.len() as u32)
            .await
            .map_err(|_| TransportError::Closed)?;
        if self.shared.closed.load(Ordering::SeqCst) {
            return Err(TransportError::Closed);
        }
        let mut st = lock(&self.shared.ctrl);
        st.flow.push_message(&msg);
        // From here `pump` gives the bytes back as their frames are posted.
        budget.forget();
        let pumped = self.shared.pump(&mut st);
        drop(st);
        pumped.inspect_err(|e| self.shared.fail(TransportError::Protocol(e.to_string())))
    }

    async fn recv(&self) -> Result<Option<Vec<u8>>, TransportError> {
        let mut rx = self.ctrl_rx.lock().await;
        match rx.recv().await {
            Some(Ctrl::Message(m)) => {
                let left = self.shared.backlog.fetch_sub(1, Ordering::SeqCst) - 1;
                if left < CTRL_BACKLOG {
                    let mut st = lock(&self.shared.ctrl);
                    st.flow.set_hold(false);
                    if let Err(e) = self.shared.pump(&mut st) {
                        drop(st);
                        self.shared.fail(e);
                    }
                }
                Ok(Some(m))
            }
            Some(Ctrl::End) | None => Ok(None),
            Some(Ctrl::Failed(e)) => Err(e),
        }
    }

    fn close(&self) {
        if self.shared.closed.swap(true, Ordering::SeqCst) {
            return;
        }
        // Senders still waiting for queue space fail; what is queued is sent.
        self.shared.ctrl_budget.close();
        let mut st = lock(&self.shared.ctrl);
        st.flow.push_close();
        if self.shared.pump(&mut st).is_err() {
            drop(st);
            self.shared.disconnect();
        }
    }
}

/// Adds the usual cause to a registration failure.
fn memlock_hint(e: TransportError) -> TransportError {
    match e {
        TransportError::Io { op, source } if source.raw_os_error() == Some(nix::libc::ENOMEM) => {
            TransportError::Io {
                op,
                source: std::io::Error::new(
                    source.kind(),
                    format!("{source} (locked-memory limit reached? see `ulimit -l`)"),
                ),
            }
        }
        other => other,
    }
}

/// Maps a failed RDMA READ/WRITE completion to the caller's error.
fn op_error(p: &Pending, c: &verbs::Completion) -> TransportError {
    if c.remote_access_error() {
        TransportError::RemoteAccess {
            op: p.op,
            fault: AccessFault::Refused,
            rkey: p.slice.rkey,
            addr: p.slice.addr,
            len: p.slice.len,
        }
    } else if c.flushed() {
        TransportError::Closed
    } else {
        TransportError::WorkRequest {
            op: match p.op {
                Op::Read => "RDMA READ",
                Op::Write => "RDMA WRITE",
            },
            status: c.status_str(),
        }
    }
}

/// The peer address and device of a connected id, for logs.
fn describe(id: &CmId, fallback: SocketAddr) -> (String, String) {
    let peer = id.peer_addr().unwrap_or(fallback).to_string();
    let device = id.device_name().unwrap_or_else(|| "unknown device".into());
    (peer, device)
}

#[cfg(test)]
mod tests;
