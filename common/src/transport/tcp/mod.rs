//! `tcp`: software RDMA over one TCP connection.
//!
//! Each side keeps a registration [`table::Table`]. A per-connection engine (a reader
//! and a writer task, and small frames written by whichever thread sends them; see
//! [`engine`]) reads frames from the socket and serves the peer's READ and
//! WRITE requests straight against that table — bounds, rkey and access checked —
//! without calling into application code, exactly as a NIC would. The application
//! only ever sees its own operations complete.
//!
//! Bounds: at most [`MAX_QUEUED_CTRL_BYTES`] of control messages wait for the socket
//! (then [`Transport::send`] waits), and at most [`CTRL_QUEUE`] received ones, each of
//! at most the length this side accepts ([`Tcp::start_with_limit`]), wait for the
//! application: a peer that sends more has the connection closed (the engine never
//! stops reading, see [`engine`]). The peer may have at most
//! [`wire::MAX_PEER_INFLIGHT_OPS`] READs and WRITEs waiting for their answers to be
//! written (a peer that does not read them has the connection closed), and a READ
//! answer out of a file window is staged a piece at a time. Once the
//! connection is closed or its last handle dropped, the engine gets [`CLOSE_GRACE`] to
//! put what is queued on the socket; a peer that does not take it by then has the
//! connection torn down (tasks aborted, operations failed, socket closed), so a peer
//! that stops reading cannot keep a closed connection's memory and descriptor alive.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use async_trait::async_trait;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::OwnedWriteHalf;
use tokio::net::{TcpStream, ToSocketAddrs};
use tokio::sync::{mpsc, oneshot, OwnedSemaphorePermit, Semaphore};
use tokio::task::AbortHandle;

use crate::codec::MAX_CTRL_FRAME_BYTES;
use crate::msg::RegionDesc;
use crate::transport::{
    Access, Buffer, Memory, Registration, RemoteSlice, Transport, TransportError, TransportKind,
    MAX_QUEUED_CTRL_BYTES,
};

mod engine;
pub mod table;
pub mod wire;

use table::Table;

/// How many received control messages may wait for the application; a peer that sends
/// more has the connection closed. A peer keeping to the protocol never has more
/// waiting: a client has at most `proto::MAX_INFLIGHT_REQUESTS` (256) requests
/// outstanding, and a server sends only the answers to them.
pub const CTRL_QUEUE: usize = 256;

/// How long a closed (or dropped) connection's engine may take to write what is still
/// queued before the connection is torn down regardless.
pub const CLOSE_GRACE: Duration = Duration::from_secs(5);

/// An operation of ours waiting for the peer's answer.
enum Pending {
    Read {
        dst: Arc<Buffer>,
        offset: usize,
        slice: RemoteSlice,
        done: oneshot::Sender<Result<(), TransportError>>,
    },
    Write {
        slice: RemoteSlice,
        done: oneshot::Sender<Result<(), TransportError>>,
    },
}

/// A frame the writer task will put on the socket.
enum Outgoing {
    /// The rest of a frame [`engine::dispatch`] began on the socket itself (or all of
    /// one it encoded): bytes to write before anything else. `served`: it answers a
    /// peer's READ or WRITE (counted in [`Shared::served_inflight`] until written);
    /// a control message keeps its share of [`MAX_QUEUED_CTRL_BYTES`].
    Raw {
        bytes: Vec<u8>,
        served: bool,
        _queued: Option<OwnedSemaphorePermit>,
    },
    /// A control message, holding its bytes' share of [`MAX_QUEUED_CTRL_BYTES`] until
    /// it is written.
    Ctrl(Vec<u8>, OwnedSemaphorePermit),
    ReadReq {
        id: u64,
        slice: RemoteSlice,
    },
    /// Answer to a peer's READ: `Ok` carries the granted memory and range.
    ReadResp {
        id: u64,
        result: Result<(Memory, usize, u32), u8>,
    },
    WriteReq {
        id: u64,
        slice: RemoteSlice,
        src: Memory,
        offset: usize,
    },
    WriteResp {
        id: u64,
        status: u8,
    },
    /// Flush what is queued, then half-close the socket.
    Shutdown,
}

/// Who may put bytes on the socket.
///
/// Invariant: frames reach the socket in the order they were dispatched. The writer
/// task counts a frame in `queued` from the moment it is queued until its bytes were
/// flushed to the socket; a frame is written by the dispatching thread itself only
/// under this lock and only while `queued` is 0, so nothing queued can be overtaken,
/// and whatever part the socket does not take at once is queued under the same lock,
/// first in line.
struct Gate {
    queued: usize,
    /// The socket's write half; `None` once the writer task has finished with it (the
    /// write side is shut down when the last reference drops).
    sock: Option<Arc<OwnedWriteHalf>>,
}

/// State shared by the handle and the engine tasks.
struct Shared {
    peer: String,
    table: Arc<Table>,
    pending: Mutex<HashMap<u64, Pending>>,
    next_id: AtomicU64,
    /// Frames for the writer task; only [`Shared::queue`] sends here.
    out: mpsc::UnboundedSender<Outgoing>,
    gate: Mutex<Gate>,
    /// Peer READs of file windows being read on the blocking pool right now (at most
    /// [`engine::BLOCKING_READS`]).
    blocking_reads: AtomicUsize,
    closed: AtomicBool,
    /// Peer-initiated READs and WRITEs accepted but not yet answered on the socket.
    served_inflight: AtomicUsize,
    /// Longest control frame accepted from the peer.
    max_recv_ctrl: u32,
    /// Permits for the bytes of control messages queued and not yet written; closed
    /// (failing waiting senders) when the connection is.
    ctrl_budget: Arc<Semaphore>,
    /// The close grace timer has been started.
    closing: AtomicBool,
}

impl Shared {
    fn pending(&self) -> std::sync::MutexGuard<'_, HashMap<u64, Pending>> {
        // Every critical section is a single map operation: poisoning is harmless.
        self.pending.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn gate(&self) -> std::sync::MutexGuard<'_, Gate> {
        // Critical sections leave `Gate` consistent at every step: poisoning is harmless.
        self.gate.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Queues `frame` for the writer task (behind everything queued before it).
    fn queue(&self, frame: Outgoing) {
        Self::queue_locked(&mut self.gate(), &self.out, frame);
    }

    fn queue_locked(gate: &mut Gate, out: &mpsc::UnboundedSender<Outgoing>, frame: Outgoing) {
        // If the writer is gone the frame is dropped: nothing can be written anymore,
        // and the connection has failed every pending operation.
        if out.send(frame).is_ok() {
            gate.queued += 1;
        }
    }

    /// Marks the connection dead and fails every outstanding operation.
    fn fail_all(&self) {
        self.closed.store(true, Ordering::SeqCst);
        self.ctrl_budget.close();
        let drained: Vec<Pending> = self.pending().drain().map(|(_, p)| p).collect();
        for p in drained {
            let done = match p {
                Pending::Read { done, .. } | Pending::Write { done, .. } => done,
            };
            let _ = done.send(Err(TransportError::Closed));
        }
    }

    fn submit(&self, id: u64, pending: Pending, frame: Outgoing) -> Result<(), TransportError> {
        if self.closed.load(Ordering::SeqCst) {
            return Err(TransportError::Closed);
        }
        self.pending().insert(id, pending);
        engine::dispatch(self, frame);
        if self.out.is_closed() || self.closed.load(Ordering::SeqCst) {
            // The engine is gone; if it did not fail our entry, do it here.
            if let Some(Pending::Read { done, .. } | Pending::Write { done, .. }) =
                self.pending().remove(&id)
            {
                let _ = done.send(Err(TransportError::Closed));
            }
        }
        Ok(())
    }
}

/// Revokes an rkey when the [`Registration`] holding it drops.
struct Revoke {
    table: Weak<Table>,
    rkey: u32,
}

impl Drop for Revoke {
    fn drop(&mut self) {
        if let Some(t) = self.table.upgrade() {
            t.remove(self.rkey);
        }
    }
}

/// A software-RDMA connection over TCP.
pub struct Tcp {
    shared: Arc<Shared>,
    ctrl: tokio::sync::Mutex<mpsc::Receiver<Result<Vec<u8>, TransportError>>>,
    reader: AbortHandle,
    writer: AbortHandle,
}

impl Tcp {
    /// Connects to `addr` and exchanges greetings.
    pub async fn connect<A: ToSocketAddrs>(addr: A) -> Result<Tcp, TransportError> {
        let stream = TcpStream::connect(addr)
            .await
            .map_err(|source| TransportError::Io {
                op: "connect",
                source,
            })?;
        Tcp::start(stream).await
    }

    /// Wraps an accepted or connected stream and exchanges greetings.
    pub async fn start(stream: TcpStream) -> Result<Tcp, TransportError> {
        Tcp::start_with_limit(stream, MAX_CTRL_FRAME_BYTES as u32).await
    }

    /// [`Tcp::start`], accepting control frames of at most `max_recv_ctrl_bytes` from
    /// the peer (capped at [`MAX_CTRL_FRAME_BYTES`]); a longer one closes the
    /// connection before it is read. A server, which receives only requests, passes
    /// what the longest request takes, so what waits for it is bounded by
    /// [`CTRL_QUEUE`] times that.
    pub async fn start_with_limit(
        mut stream: TcpStream,
        max_recv_ctrl_bytes: u32,
    ) -> Result<Tcp, TransportError> {
        let max_recv_ctrl = max_recv_ctrl_bytes.min(MAX_CTRL_FRAME_BYTES as u32);
        let io = |op| move |source| TransportError::Io { op, source };
        stream.set_nodelay(true).map_err(io("set TCP_NODELAY"))?;
        let peer = stream
            .peer_addr()
            .map(|a| a.to_string())
            .unwrap_or_else(|_| "unknown peer".into());
        stream
            .write_all(&wire::GREETING)
            .await
            .map_err(io("send greeting"))?;
        let mut greeting = [0u8; 8];
        stream
            .read_exact(&mut greeting)
            .await
            .map_err(io("receive greeting"))?;
        if greeting != wire::GREETING {
            return Err(TransportError::Protocol(format!(
                "{peer} does not speak Ferry's TCP transport (greeting {greeting:02x?})"
            )));
        }
        let (r, w) = stream.into_split();
        let (out_tx, out_rx) = mpsc::unbounded_channel();
        let gate = Gate {
            queued: 0,
            sock: Some(Arc::new(w)),
        };
        let (ctrl_tx, ctrl_rx) = mpsc::channel(CTRL_QUEUE);
        let shared = Arc::new(Shared {
            peer,
            table: Arc::new(Table::new(rand::random())),
            pending: Mutex::new(HashMap::new()),
            next_id: AtomicU64::new(1),
            out: out_tx,
            gate: Mutex::new(gate),
            blocking_reads: AtomicUsize::new(0),
            closed: AtomicBool::new(false),
            served_inflight: AtomicUsize::new(0),
            max_recv_ctrl,
            ctrl_budget: Arc::new(Semaphore::new(MAX_QUEUED_CTRL_BYTES)),
            closing: AtomicBool::new(false),
        });
        let reader = tokio::spawn(engine::reader(shared.clone(), r, ctrl_tx)).abort_handle();
        let writer = tokio::spawn(engine::writer(shared.clone(), out_rx)).abort_handle();
        Ok(Tcp {
            shared,
            ctrl: tokio::sync::Mutex::new(ctrl_rx),
            reader,
            writer,
        })
    }

    /// Number of live registrations on this connection (for leak checks).
    pub fn registrations(&self) -> usize {
        self.shared.table.len()
    }

    fn next_id(&self) -> u64 {
        self.shared.next_id.fetch_add(1, Ordering::Relaxed)
    }

    /// Starts (once) the [`CLOSE_GRACE`] timer: if the writer has not finished by
    /// then, both engine tasks are aborted (closing the socket) and every outstanding
    /// operation fails. Needs a tokio runtime; without one (a handle dropped after its
    /// runtime) there is no task left to stop.
    fn start_close_grace(&self) {
        if self.shared.closing.swap(true, Ordering::SeqCst) {
            return;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let shared = Arc::downgrade(&self.shared);
        let (reader, writer) = (self.reader.clone(), self.writer.clone());
        runtime.spawn(async move {
            tokio::time::sleep(CLOSE_GRACE).await;
            if writer.is_finished() {
                return;
            }
            writer.abort();
            reader.abort();
            if let Some(shared) = shared.upgrade() {
                // Close the socket now, not when the last handle goes.
                shared.gate().sock = None;
                tracing::debug!(peer = %shared.peer, "peer took nothing for {CLOSE_GRACE:?} after close; connection torn down");
                shared.fail_all();
            }
        });
    }
}

impl Drop for Tcp {
    fn drop(&mut self) {
        self.shared.queue(Outgoing::Shutdown);
        self.reader.abort();
        self.shared.fail_all();
        self.start_close_grace();
    }
}

#[async_trait]
impl Transport for Tcp {
    fn kind(&self) -> TransportKind {
        TransportKind::Tcp
    }

    fn peer(&self) -> String {
        self.shared.peer.clone()
    }

    fn register(&self, memory: Memory, access: Access) -> Result<Registration, TransportError> {
        if access.remote_write() && !memory.is_writable() {
            return Err(TransportError::Local(
                "a file window cannot be registered for remote write",
            ));
        }
        let rkey = self.shared.table.insert(memory.clone(), access);
        let desc = RegionDesc {
            addr: memory.addr(),
            len: memory.len() as u64,
            rkey,
        };
        let revoke = Revoke {
            table: Arc::downgrade(&self.shared.table),
            rkey,
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
        let id = self.next_id();
        let (done, wait) = oneshot::channel();
        let pending = Pending::Read {
            dst: buf.clone(),
            offset: dst_offset,
            slice: src,
            done,
        };
        self.shared
            .submit(id, pending, Outgoing::ReadReq { id, slice: src })?;
        wait.await.map_err(|_| TransportError::Closed)?
    }

    async fn write(
        &self,
        src: &Registration,
        src_offset: usize,
        dst: RemoteSlice,
    ) -> Result<(), TransportError> {
        src.check_write_source(src_offset, dst.len)?;
        let id = self.next_id();
        let (done, wait) = oneshot::channel();
        let frame = Outgoing::WriteReq {
            id,
            slice: dst,
            src: src.memory().clone(),
            offset: src_offset,
        };
        self.shared
            .submit(id, Pending::Write { slice: dst, done }, frame)?;
        wait.await.map_err(|_| TransportError::Closed)?
    }

    async fn send(&self, msg: Vec<u8>) -> Result<(), TransportError> {
        if msg.len() > crate::codec::MAX_CTRL_FRAME_BYTES {
            return Err(TransportError::Local("control message too large"));
        }
        // Waits while MAX_QUEUED_CTRL_BYTES are queued (a message is at most
        // MAX_CTRL_FRAME_BYTES, which is less, so one always fits eventually).
        let queued = self
            .shared
            .ctrl_budget
            .clone()
            .acquire_many_owned(msg.len() as u32)
            .await
            .map_err(|_| TransportError::Closed)?;
        if self.shared.closed.load(Ordering::SeqCst) || self.shared.out.is_closed() {
            return Err(TransportError::Closed);
        }
        engine::dispatch(&self.shared, Outgoing::Ctrl(msg, queued));
        Ok(())
    }

    async fn recv(&self) -> Result<Option<Vec<u8>>, TransportError> {
        match self.ctrl.lock().await.recv().await {
            Some(Ok(msg)) => Ok(Some(msg)),
            Some(Err(e)) => Err(e),
            None => Ok(None),
        }
    }

    fn close(&self) {
        // Senders still waiting for queue space fail; what is queued is written.
        self.shared.ctrl_budget.close();
        self.shared.queue(Outgoing::Shutdown);
        self.start_close_grace();
    }
}

#[cfg(test)]
mod tests;
