//! `tcp`: software RDMA over one TCP connection.
//!
//! Each side keeps a registration [`table::Table`]. A per-connection engine (two tokio
//! tasks, see [`engine`]) reads frames from the socket and serves the peer's READ and
//! WRITE requests straight against that table — bounds, rkey and access checked —
//! without calling into application code, exactly as a NIC would. The application
//! only ever sees its own operations complete.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};

use async_trait::async_trait;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpStream, ToSocketAddrs};
use tokio::sync::{mpsc, oneshot};
use tokio::task::AbortHandle;

use crate::msg::RegionDesc;
use crate::transport::{
    Access, Buffer, Memory, Registration, RemoteSlice, Transport, TransportError, TransportKind,
};

mod engine;
pub mod table;
pub mod wire;

use table::Table;

/// How many received control messages may wait for the application before the engine
/// stops reading the socket (back-pressure on the peer).
const CTRL_QUEUE: usize = 256;

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
    Ctrl(Vec<u8>),
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

/// State shared by the handle and the engine tasks.
struct Shared {
    peer: String,
    table: Arc<Table>,
    pending: Mutex<HashMap<u64, Pending>>,
    next_id: AtomicU64,
    out: mpsc::UnboundedSender<Outgoing>,
    closed: AtomicBool,
    /// Peer-initiated READs accepted but not yet answered on the socket.
    served_inflight: AtomicUsize,
}

impl Shared {
    fn pending(&self) -> std::sync::MutexGuard<'_, HashMap<u64, Pending>> {
        // Every critical section is a single map operation: poisoning is harmless.
        self.pending.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Marks the connection dead and fails every outstanding operation.
    fn fail_all(&self) {
        self.closed.store(true, Ordering::SeqCst);
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
        if self.out.send(frame).is_err() || self.closed.load(Ordering::SeqCst) {
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
    pub async fn start(mut stream: TcpStream) -> Result<Tcp, TransportError> {
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
        let (ctrl_tx, ctrl_rx) = mpsc::channel(CTRL_QUEUE);
        let shared = Arc::new(Shared {
            peer,
            table: Arc::new(Table::new(rand::random())),
            pending: Mutex::new(HashMap::new()),
            next_id: AtomicU64::new(1),
            out: out_tx,
            closed: AtomicBool::new(false),
            served_inflight: AtomicUsize::new(0),
        });
        let reader = tokio::spawn(engine::reader(shared.clone(), r, ctrl_tx)).abort_handle();
        tokio::spawn(engine::writer(shared.clone(), w, out_rx));
        Ok(Tcp {
            shared,
            ctrl: tokio::sync::Mutex::new(ctrl_rx),
            reader,
        })
    }

    /// Number of live registrations on this connection (for leak checks).
    pub fn registrations(&self) -> usize {
        self.shared.table.len()
    }

    fn next_id(&self) -> u64 {
        self.shared.next_id.fetch_add(1, Ordering::Relaxed)
    }
}

impl Drop for Tcp {
    fn drop(&mut self) {
        let _ = self.shared.out.send(Outgoing::Shutdown);
        self.reader.abort();
        self.shared.fail_all();
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
        if self.shared.closed.load(Ordering::SeqCst) {
            return Err(TransportError::Closed);
        }
        self.shared
            .out
            .send(Outgoing::Ctrl(msg))
            .map_err(|_| TransportError::Closed)
    }

    async fn recv(&self) -> Result<Option<Vec<u8>>, TransportError> {
        match self.ctrl.lock().await.recv().await {
            Some(Ok(msg)) => Ok(Some(msg)),
            Some(Err(e)) => Err(e),
            None => Ok(None),
        }
    }

    fn close(&self) {
        let _ = self.shared.out.send(Outgoing::Shutdown);
    }
}

#[cfg(test)]
mod tests;
