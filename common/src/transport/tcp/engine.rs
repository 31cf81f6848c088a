//! The per-connection engine: a reader task, a writer task, and the direct path.
//!
//! The reader decodes frames. Control messages go to the application's queue; the
//! peer's READ/WRITE requests are served on the spot against the registration table
//! (a WRITE's payload is read straight into the granted buffer); answers to our own
//! operations complete them.
//!
//! Outgoing frames go through [`dispatch`]. A small frame (a control message, a READ
//! request, a WRITE of at most [`DIRECT_BYTES`] from a buffer, an answer to the peer)
//! is written to the socket by the thread that dispatches it, when nothing is queued
//! before it: a hand-off to the writer task costs a thread wake-up, tens of µs on a
//! small VM, which is more than the write. Everything else is queued for the writer
//! task, which writes large payloads straight from their memory and flushes whenever
//! its queue runs dry; a direct write the socket does not take whole is finished by
//! the writer, before anything queued after it ([`Gate`](super::Gate) keeps the order).
//! A peer's READ of at most [`DIRECT_BYTES`] of a file window is copied right away
//! when the page cache holds it (`RWF_NOWAIT`), or else on the blocking pool (at most
//! [`BLOCKING_READS`] at once), whose thread then sends the answer itself.
//!
//! Invariant: memory is only ever touched inside a range the table granted (peer
//! operations) or that the local caller registered and bounds-checked (own operations).
//!
//! File windows are never read through their mapping here: their bytes are copied with
//! `pread(2)` ([`FileWindow::read_at`], [`FileWindow::read_cached_prefix`]) into a staging
//! buffer (the frame itself on the direct path), at most [`STAGE_PIECE_BYTES`] at a
//! time; the first piece and the last byte of the range are
//! read before the frame that carries them is started. A file truncated under a
//! registered window therefore fails that one operation (a peer's READ is answered
//! with [`wire::STATUS_UNREADABLE`]; our own WRITE completes with an I/O error) instead
//! of raising SIGBUS and killing the process; the connection goes on. Only a file that
//! shrinks while a frame of it is being sent ends the connection (the frame cannot be
//! taken back).
//!
//! The reader never waits for the application: it must go on completing this side's
//! own operations, which the application may be waiting for before it takes another
//! message. So a peer that sends more control messages than may wait for the
//! application ([`CTRL_QUEUE`]: more than a peer keeping to the protocol's limit of
//! outstanding requests ever has waiting), or one longer than this side accepts, has
//! the connection closed rather than read later.
//!
//! Hostile peers: the peer may have at most [`MAX_PEER_INFLIGHT_OPS`] READs and WRITEs
//! waiting for their answers to be written, and its refused accesses are logged only
//! up to [`LOGGED_REFUSALS`] per connection (then counted), so neither a peer that
//! never reads its answers nor one that sends refused accesses at wire speed makes
//! this side's memory or log grow without bound.

use std::io::IoSlice;
use std::os::fd::AsRawFd;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use nix::sys::socket::{sendmsg, MsgFlags};
use tokio::io::{AsyncReadExt, BufReader, Interest};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::sync::{mpsc, oneshot, OwnedSemaphorePermit};

use super::wire::{self, Header, Parsed, MAX_PEER_INFLIGHT_OPS, STATUS_OK, STATUS_UNREADABLE};
use super::{Outgoing, Pending, Shared, CTRL_QUEUE};
use crate::transport::{AccessFault, Buffer, FileWindow, Memory, Op, RemoteSlice, TransportError};

/// Socket buffer size for both directions: large enough that a chunk moves in few
/// system calls, small enough to be cheap per connection.
const IO_BUF_BYTES: usize = 256 << 10;

/// Most bytes of a file window staged at once (the writer's staging buffer never
/// grows beyond this).
pub(super) const STAGE_PIECE_BYTES: usize = 4 << 20;

/// Refused peer accesses logged per connection; later ones are only counted.
pub(super) const LOGGED_REFUSALS: u64 = 16;

type CtrlTx = mpsc::Sender<Result<Vec<u8>, TransportError>>;

/// Completes one of our own operations.
type Done = oneshot::Sender<Result<(), TransportError>>;

fn io(op: &'static str) -> impl FnOnce(std::io::Error) -> TransportError {
    move |source| TransportError::Io { op, source }
}

/// Runs until the peer closes or breaks the framing; then fails every pending
/// operation and ends the control queue (with the error, if there was one).
pub(super) async fn reader(shared: Arc<Shared>, r: OwnedReadHalf, ctrl: CtrlTx) {
    let mut r = BufReader::with_capacity(IO_BUF_BYTES, r);
    let result = read_loop(&shared, &mut r, &ctrl).await;
    shared.fail_all();
    match result {
        Ok(()) => {}
        Err(e) => {
            // A broken rule is logged here: the application may see it only after
            // the messages queued before it, if at all.
            if matches!(e, TransportError::Protocol(_)) {
                tracing::warn!(peer = %shared.peer, "closing the connection: {e}");
            } else {
                tracing::debug!(peer = %shared.peer, "transport closed: {e}");
            }
            let _ = ctrl.send(Err(e)).await;
        }
    }
    // Make the writer stop too: nothing more can be answered.
    shared.queue(Outgoing::Shutdown);
}

/// Reads the next frame header, exactly its bytes; `None` if the stream ended cleanly
/// at a frame boundary.
async fn read_header(r: &mut BufReader<OwnedReadHalf>) -> Result<Option<Header>, TransportError> {
    let mut bytes = [0u8; wire::MAX_HEADER_BYTES];
    let mut filled = 0;
    loop {
        match Header::parse(&bytes[..filled])? {
            Parsed::Header { header, .. } => return Ok(Some(header)),
            // `Header::parse` asks for more than it was given, and never for more
            // than MAX_HEADER_BYTES.
            Parsed::Need(need) => match r.read_exact(&mut bytes[filled..need]).await {
                Ok(_) => filled = need,
                Err(e) if filled == 0 && e.kind() == std::io::ErrorKind::UnexpectedEof => {
                    return Ok(None)
                }
                Err(e) => return Err(io("read frame")(e)),
            },
        }
    }
}

/// Logs the peer's refused accesses, the first [`LOGGED_REFUSALS`] of them, and how
/// many there were in all when the connection ends.
struct Refusals<'a> {
    peer: &'a str,
    count: u64,
}

impl Refusals<'_> {
    fn log(&mut self, op: Op, slice: RemoteSlice, fault: AccessFault) {
        let peer = self.peer;
        self.count += 1;
        let RemoteSlice { rkey, addr, len } = slice;
        let op = match op {
            Op::Read => "READ",
            Op::Write => "WRITE",
        };
        if self.count <= LOGGED_REFUSALS {
            tracing::warn!(%peer, rkey, addr, len, "refused peer {op}: {fault}");
        }
        if self.count == LOGGED_REFUSALS {
            tracing::warn!(%peer, "further refused accesses of this peer are only counted");
        }
    }
}

impl Drop for Refusals<'_> {
    fn drop(&mut self) {
        if self.count > LOGGED_REFUSALS {
            tracing::info!(peer = %self.peer, "{} peer accesses refused on this connection in all", self.count);
        }
    }
}

/// Counts one more peer READ or WRITE waiting for its answer to be written; fails if
/// the peer has more than [`MAX_PEER_INFLIGHT_OPS`] (it is not reading them).
fn count_served(shared: &Shared) -> Result<(), TransportError> {
    let inflight = shared.served_inflight.fetch_add(1, Ordering::SeqCst) + 1;
    if inflight > MAX_PEER_INFLIGHT_OPS {
        return Err(TransportError::Protocol(format!(
            "peer has more than {MAX_PEER_INFLIGHT_OPS} READs and WRITEs awaiting their answers"
        )));
    }
    Ok(())
}

async fn read_loop(
    shared: &Arc<Shared>,
    r: &mut BufReader<OwnedReadHalf>,
    ctrl: &CtrlTx,
) -> Result<(), TransportError> {
    let mut refusals = Refusals {
        peer: &shared.peer,
        count: 0,
    };
    while let Some(header) = read_header(r).await? {
        match header {
            Header::Ctrl { len } => recv_ctrl(shared, r, ctrl, len).await?,
            Header::ReadReq { id, slice } => {
                count_served(shared)?;
                let RemoteSlice { rkey, addr, len } = slice;
                let result = match shared.table.check(Op::Read, rkey, addr, len) {
                    Ok(g) => Ok((g.memory, g.offset, len)),
                    Err(fault) => {
                        refusals.log(Op::Read, slice, fault);
                        Err(wire::status_of(fault))
                    }
                };
                serve_read(shared, id, result);
            }
            Header::WriteReq { id, slice } => {
                count_served(shared)?;
                let status = take_write(shared, r, slice, &mut refusals).await?;
                dispatch(shared, Outgoing::WriteResp { id, status });
            }
            Header::ReadData { id, len } => take_read_data(shared, r, id, len).await?,
            Header::ReadRefused { id, status } => {
                let (_, _, slice, done) = pending_read(shared, id)?;
                let _ = done.send(Err(refused(Op::Read, status, slice)?));
            }
            Header::WriteResp { id, status } => {
                let Some(Pending::Write { slice, done }) = shared.pending().remove(&id) else {
                    return Err(TransportError::Protocol(format!(
                        "WRITE response for unknown operation {id}"
                    )));
                };
                let result = if status == STATUS_OK {
                    Ok(())
                } else {
                    Err(refused(Op::Write, status, slice)?)
                };
                let _ = done.send(result);
            }
        }
    }
    Ok(())
}

/// Takes a control frame of `len` bytes off the stream and queues it for the
/// application; a peer that sends more than the queue holds is refused.
async fn recv_ctrl(
    shared: &Shared,
    r: &mut BufReader<OwnedReadHalf>,
    ctrl: &CtrlTx,
    len: u32,
) -> Result<(), TransportError> {
    // `Header::parse` refused anything over MAX_CTRL_FRAME_BYTES; this side may accept
    // less.
    if len > shared.max_recv_ctrl {
        return Err(TransportError::Protocol(format!(
            "control frame of {len} bytes exceeds the {} this side accepts",
            shared.max_recv_ctrl
        )));
    }
    let mut msg = vec![0u8; len as usize];
    r.read_exact(&mut msg).await.map_err(io("read frame"))?;
    match ctrl.try_send(Ok(msg)) {
        Ok(()) => Ok(()),
        Err(mpsc::error::TrySendError::Full(_)) => Err(TransportError::Protocol(format!(
            "peer has more than {CTRL_QUEUE} control messages waiting to be taken"
        ))),
        // The application dropped its end; keep serving one-sided ops.
        Err(mpsc::error::TrySendError::Closed(_)) => Ok(()),
    }
}

/// Serves the peer's WRITE of `slice`: its payload lands in our memory if the table
/// grants it, else is read and dropped. Returns the status to answer.
async fn take_write(
    shared: &Shared,
    r: &mut BufReader<OwnedReadHalf>,
    slice: RemoteSlice,
    refusals: &mut Refusals<'_>,
) -> Result<u8, TransportError> {
    let RemoteSlice { rkey, addr, len } = slice;
    match shared.table.check(Op::Write, rkey, addr, len) {
        Ok(g) => {
            let Memory::Buffer(buf) = g.memory else {
                // The table grants remote write only to buffers.
                return Err(TransportError::Protocol(
                    "write granted to read-only memory".into(),
                ));
            };
            let mut bytes = buf.write().await;
            r.read_exact(&mut bytes[g.offset..g.offset + len as usize])
                .await
                .map_err(io("read WRITE payload"))?;
            Ok(STATUS_OK)
        }
        Err(fault) => {
            refusals.log(Op::Write, slice, fault);
            discard(r, u64::from(len)).await?;
            Ok(wire::status_of(fault))
        }
    }
}

/// Takes the `len` bytes answering our READ `id` into its destination, and completes
/// it.
async fn take_read_data(
    shared: &Shared,
    r: &mut BufReader<OwnedReadHalf>,
    id: u64,
    len: u32,
) -> Result<(), TransportError> {
    let (dst, offset, slice, done) = pending_read(shared, id)?;
    if len != slice.len {
        return Err(TransportError::Protocol(format!(
            "READ response of {len} bytes for a {}-byte READ",
            slice.len
        )));
    }
    let mut bytes = dst.write().await;
    r.read_exact(&mut bytes[offset..offset + len as usize])
        .await
        .map_err(io("read READ payload"))?;
    drop(bytes);
    let _ = done.send(Ok(()));
    Ok(())
}

/// Takes our READ `id` out of the pending table: its destination buffer and offset,
/// the remote slice and the completion.
fn pending_read(
    shared: &Shared,
    id: u64,
) -> Result<(Arc<Buffer>, usize, RemoteSlice, Done), TransportError> {
    match shared.pending().remove(&id) {
        Some(Pending::Read {
            dst,
            offset,
            slice,
            done,
        }) => Ok((dst, offset, slice, done)),
        _ => Err(TransportError::Protocol(format!(
            "READ response for unknown operation {id}"
        ))),
    }
}

fn refused(op: Op, status: u8, s: RemoteSlice) -> Result<TransportError, TransportError> {
    let fault = wire::fault_of(status)
        .ok_or_else(|| TransportError::Protocol(format!("unknown status {status}")))?;
    Ok(TransportError::RemoteAccess {
        op,
        fault,
        rkey: s.rkey,
        addr: s.addr,
        len: s.len,
    })
}

/// Skips `len` payload bytes of a refused WRITE without storing them.
async fn discard(r: &mut BufReader<OwnedReadHalf>, len: u64) -> Result<(), TransportError> {
    let copied = tokio::io::copy(&mut r.take(len), &mut tokio::io::sink())
        .await
        .map_err(io("discard WRITE payload"))?;
    if copied != len {
        return Err(io("discard WRITE payload")(
            std::io::ErrorKind::UnexpectedEof.into(),
        ));
    }
    Ok(())
}

/// Frames carrying at most this many payload bytes may be written by the thread that
/// dispatches them; larger ones always go through the writer task, which sends them
/// straight from their memory.
pub(super) const DIRECT_BYTES: usize = 64 << 10;

/// Most peer READs of uncached file windows read on the blocking pool at once, per
/// connection; more wait for the writer task, which reads them one at a time.
pub(super) const BLOCKING_READS: usize = 4;

/// Sends `frame`. A small frame is written to the socket by the calling thread itself
/// when nothing is queued before it (see [`Gate`](super::Gate)): no hand-off to the
/// writer task, whose wake-up would cost more than the write. Everything else, and
/// what the socket does not take at once, is queued for the writer task.
pub(super) fn dispatch(shared: &Shared, frame: Outgoing) {
    match frame {
        Outgoing::Ctrl(msg, queued) if msg.len() <= DIRECT_BYTES => {
            let len = msg.len() as u32;
            emit(shared, Header::Ctrl { len }, &msg, false, Some(queued));
        }
        Outgoing::ReadReq { id, slice } => {
            emit(shared, Header::ReadReq { id, slice }, &[], false, None)
        }
        Outgoing::WriteResp { id, status } => {
            emit(shared, Header::WriteResp { id, status }, &[], true, None)
        }
        Outgoing::ReadResp {
            id,
            result: Err(status),
        } => emit(shared, Header::ReadRefused { id, status }, &[], true, None),
        Outgoing::ReadResp {
            id,
            result: Ok((Memory::Buffer(b), offset, len)),
        } if len as usize <= DIRECT_BYTES => {
            let header = Header::ReadData { id, len };
            if !emit_buffer(shared, header, &b, offset, true) {
                let result = Ok((Memory::Buffer(b), offset, len));
                shared.queue(Outgoing::ReadResp { id, result });
            }
        }
        Outgoing::WriteReq {
            id,
            slice,
            src: Memory::Buffer(b),
            offset,
        } if slice.len as usize <= DIRECT_BYTES => {
            let header = Header::WriteReq { id, slice };
            if !emit_buffer(shared, header, &b, offset, false) {
                let src = Memory::Buffer(b);
                shared.queue(Outgoing::WriteReq {
                    id,
                    slice,
                    src,
                    offset,
                });
            }
        }
        frame => shared.queue(frame),
    }
}

/// [`emit`] of `header` with its payload taken from `b` at `offset` (a range checked
/// against the buffer by the caller), if no one is writing the buffer now; `false`
/// (nothing done) if someone is.
fn emit_buffer(shared: &Shared, header: Header, b: &Buffer, offset: usize, served: bool) -> bool {
    let len = header.payload_len() as usize;
    match b.try_read() {
        Some(bytes) => {
            emit(shared, header, &bytes[offset..offset + len], served, None);
            true
        }
        None => false,
    }
}

/// Answers the peer's READ `id`. A small range of a file window is read here when the
/// page cache holds it (no disk wait), or else on the blocking pool, which then sends
/// the answer itself: either way no hand-off to the writer task. Large ranges, and
/// small ones while [`BLOCKING_READS`] are already being read, are the writer's.
fn serve_read(shared: &Arc<Shared>, id: u64, result: Result<(Memory, usize, u32), u8>) {
    let (window, offset, len) = match result {
        Ok((Memory::File(f), offset, len)) if len as usize <= DIRECT_BYTES => (f, offset, len),
        result => return dispatch(shared, Outgoing::ReadResp { id, result }),
    };
    let mut frame = Vec::with_capacity(wire::MAX_HEADER_BYTES + len as usize);
    Header::ReadData { id, len }.encode(&mut frame);
    let head = frame.len();
    frame.resize(head + len as usize, 0);
    // The cached start is kept: only the rest is read on the blocking pool.
    let cached = window.read_cached_prefix(offset, &mut frame[head..]);
    if cached == len as usize {
        return emit_bytes(shared, &frame, true);
    }
    let busy = shared.blocking_reads.fetch_add(1, Ordering::SeqCst) >= BLOCKING_READS;
    if busy {
        shared.blocking_reads.fetch_sub(1, Ordering::SeqCst);
        let result = Ok((Memory::File(window), offset, len));
        return shared.queue(Outgoing::ReadResp { id, result });
    }
    let shared = shared.clone();
    tokio::task::spawn_blocking(move || {
        let read = window.read_at(offset + cached, &mut frame[head + cached..]);
        // Counted down before the answer goes out: once the peer has it, the slot is free.
        shared.blocking_reads.fetch_sub(1, Ordering::SeqCst);
        match read {
            Ok(()) => emit_bytes(&shared, &frame, true),
            Err(e) => {
                tracing::warn!(peer = %shared.peer, len, "cannot serve peer READ of a file window: {e}");
                let status = STATUS_UNREADABLE;
                emit(&shared, Header::ReadRefused { id, status }, &[], true, None);
            }
        }
    });
}

/// [`emit_bytes`] of `header` followed by `payload`.
fn emit(
    shared: &Shared,
    header: Header,
    payload: &[u8],
    served: bool,
    queued: Option<OwnedSemaphorePermit>,
) {
    let mut head = Vec::with_capacity(wire::MAX_HEADER_BYTES);
    header.encode(&mut head);
    emit_parts(shared, &head, payload, served, queued);
}

/// Puts one whole encoded frame on the socket now if nothing is queued before it, or
/// queues what the socket did not take. `served`: it answers a peer's READ or WRITE,
/// counted in `served_inflight` until written.
fn emit_bytes(shared: &Shared, frame: &[u8], served: bool) {
    emit_parts(shared, frame, &[], served, None);
}

fn emit_parts(
    shared: &Shared,
    head: &[u8],
    payload: &[u8],
    served: bool,
    queued: Option<OwnedSemaphorePermit>,
) {
    let total = head.len() + payload.len();
    let mut gate = shared.gate();
    let mut sent = 0;
    if gate.queued == 0 {
        if let Some(sock) = &gate.sock {
            sent = try_put(sock, head, payload);
        }
    }
    if sent == total {
        if served {
            shared.served_inflight.fetch_sub(1, Ordering::SeqCst);
        }
        return;
    }
    let mut bytes = Vec::with_capacity(total - sent);
    if sent < head.len() {
        bytes.extend_from_slice(&head[sent..]);
        bytes.extend_from_slice(payload);
    } else {
        bytes.extend_from_slice(&payload[sent - head.len()..]);
    }
    let frame = Outgoing::Raw {
        bytes,
        served,
        _queued: queued,
    };
    Shared::queue_locked(&mut gate, &shared.out, frame);
}

/// Writes as much of `head` then `payload` as the socket takes without waiting; how
/// many bytes. A failed write stops here too: the writer task meets the error when it
/// writes the rest, and fails the connection.
fn try_put(sock: &OwnedWriteHalf, head: &[u8], payload: &[u8]) -> usize {
    let total = head.len() + payload.len();
    let mut sent = 0;
    while sent < total {
        let parts = if sent < head.len() {
            [IoSlice::new(&head[sent..]), IoSlice::new(payload)]
        } else {
            [
                IoSlice::new(&payload[sent - head.len()..]),
                IoSlice::new(&[]),
            ]
        };
        match send_vectored(sock, &parts) {
            Ok(n) if n > 0 => sent += n,
            _ => break,
        }
    }
    sent
}

/// One non-blocking gathered send on `sock`. It is `sendmsg` with `MSG_NOSIGNAL`, not
/// `writev` (what tokio's `try_write_vectored` calls): a peer that has gone away makes
/// it fail with `EPIPE` rather than raise `SIGPIPE`, which would kill a host program
/// that, unlike a Rust `main`, has not set `SIGPIPE` to be ignored.
fn send_vectored(sock: &OwnedWriteHalf, parts: &[IoSlice<'_>]) -> std::io::Result<usize> {
    let stream: &tokio::net::TcpStream = sock.as_ref();
    stream.try_io(Interest::WRITABLE, || {
        let flags = MsgFlags::MSG_NOSIGNAL | MsgFlags::MSG_DONTWAIT;
        sendmsg::<()>(stream.as_raw_fd(), parts, &[], flags, None).map_err(std::io::Error::from)
    })
}

/// Writes queued frames until told to shut down or the socket fails.
pub(super) async fn writer(shared: Arc<Shared>, mut queue: mpsc::UnboundedReceiver<Outgoing>) {
    let Some(sock) = shared.gate().sock.clone() else {
        return;
    };
    let mut w = SockWriter::new(sock);
    let mut staging = Vec::new();
    let result = write_loop(&shared, &mut w, &mut queue, &mut staging).await;
    if let Err(e) = &result {
        tracing::debug!(peer = %shared.peer, "transport writer stopped: {e}");
    }
    shared.fail_all();
    // The write side shuts down once the last reference to it drops: ours, now, and
    // the gate's (no frame is written directly once it is gone).
    shared.gate().sock = None;
}

async fn write_loop(
    shared: &Shared,
    w: &mut SockWriter,
    queue: &mut mpsc::UnboundedReceiver<Outgoing>,
    staging: &mut Vec<u8>,
) -> Result<(), TransportError> {
    // Frames taken from the queue whose bytes may still sit in `w`'s buffer.
    let mut unflushed = 0;
    while let Some(frame) = queue.recv().await {
        unflushed += 1;
        match frame {
            Outgoing::Shutdown => {
                w.flush().await.map_err(io("flush"))?;
                return Ok(());
            }
            Outgoing::Raw { bytes, served, .. } => {
                let sent = w.write_all(&bytes).await.map_err(io("send"));
                if served {
                    shared.served_inflight.fetch_sub(1, Ordering::SeqCst);
                }
                sent?;
            }
            Outgoing::Ctrl(msg, _queued) => {
                // `Tcp::send` refused anything over MAX_CTRL_FRAME_BYTES. The message's
                // share of the send queue is given back once it is in the socket buffer.
                let len = msg.len() as u32;
                write_header(w, Header::Ctrl { len }).await?;
                w.write_all(&msg).await.map_err(io("send"))?;
            }
            Outgoing::ReadReq { id, slice } => {
                write_header(w, Header::ReadReq { id, slice }).await?;
            }
            Outgoing::ReadResp { id, result } => {
                let sent = send_read_resp(shared, w, id, result, staging).await;
                shared.served_inflight.fetch_sub(1, Ordering::SeqCst);
                sent?;
            }
            Outgoing::WriteReq {
                id,
                slice,
                src,
                offset,
            } => send_write_req(shared, w, id, slice, src, offset, staging).await?,
            Outgoing::WriteResp { id, status } => {
                let sent = write_header(w, Header::WriteResp { id, status }).await;
                shared.served_inflight.fetch_sub(1, Ordering::SeqCst);
                sent?;
            }
        }
        if queue.is_empty() {
            w.flush().await.map_err(io("flush"))?;
            // Everything taken so far is on the socket: frames dispatched from now on
            // may be written directly (unless more were queued meanwhile).
            shared.gate().queued -= unflushed;
            unflushed = 0;
        }
    }
    Ok(())
}

/// A buffered writer over the shared write half: small writes are gathered and go out
/// on [`SockWriter::flush`] or when the buffer fills; large ones go straight from the
/// caller's memory.
struct SockWriter {
    sock: Arc<OwnedWriteHalf>,
    buf: Vec<u8>,
}

impl SockWriter {
    fn new(sock: Arc<OwnedWriteHalf>) -> SockWriter {
        SockWriter {
            sock,
            buf: Vec::with_capacity(IO_BUF_BYTES),
        }
    }

    async fn write_all(&mut self, bytes: &[u8]) -> std::io::Result<()> {
        if self.buf.len() + bytes.len() > IO_BUF_BYTES {
            self.flush().await?;
        }
        if bytes.len() >= IO_BUF_BYTES {
            put(&self.sock, bytes).await
        } else {
            self.buf.extend_from_slice(bytes);
            Ok(())
        }
    }

    async fn flush(&mut self) -> std::io::Result<()> {
        if !self.buf.is_empty() {
            put(&self.sock, &self.buf).await?;
            self.buf.clear();
        }
        Ok(())
    }
}

/// Writes all of `bytes`, waiting for the socket whenever it is full.
async fn put(sock: &OwnedWriteHalf, mut bytes: &[u8]) -> std::io::Result<()> {
    while !bytes.is_empty() {
        match sock.try_write(bytes) {
            Ok(0) => return Err(std::io::ErrorKind::WriteZero.into()),
            Ok(n) => bytes = &bytes[n..],
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => sock.writable().await?,
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

async fn write_header(w: &mut SockWriter, header: Header) -> Result<(), TransportError> {
    let mut bytes = Vec::with_capacity(wire::MAX_HEADER_BYTES);
    header.encode(&mut bytes);
    w.write_all(&bytes).await.map_err(io("send"))
}

/// Answers a peer's READ. A granted file window whose range cannot be read (the file
/// shrank) is answered [`STATUS_UNREADABLE`] instead of data.
async fn send_read_resp(
    shared: &Shared,
    w: &mut SockWriter,
    id: u64,
    result: Result<(Memory, usize, u32), u8>,
    staging: &mut Vec<u8>,
) -> Result<(), TransportError> {
    let status = match result {
        Err(status) => status,
        Ok((Memory::Buffer(b), offset, len)) => {
            write_header(w, Header::ReadData { id, len }).await?;
            return write_buffer(w, &b, offset, len).await;
        }
        Ok((Memory::File(f), offset, len)) => {
            let header = Header::ReadData { id, len };
            match send_file_frame(w, header, &f, offset, staging).await? {
                Ok(()) => return Ok(()),
                Err(e) => {
                    tracing::warn!(peer = %shared.peer, len, "cannot serve peer READ of a file window: {e}");
                    STATUS_UNREADABLE
                }
            }
        }
    };
    write_header(w, Header::ReadRefused { id, status }).await
}

/// Sends our own WRITE. If a file-window source cannot be read, nothing is sent and
/// the operation completes with the I/O error.
async fn send_write_req(
    shared: &Shared,
    w: &mut SockWriter,
    id: u64,
    slice: RemoteSlice,
    src: Memory,
    offset: usize,
    staging: &mut Vec<u8>,
) -> Result<(), TransportError> {
    let header = Header::WriteReq { id, slice };
    match src {
        Memory::File(f) => {
            if let Err(source) = send_file_frame(w, header, &f, offset, staging).await? {
                if let Some(Pending::Write { done, .. }) = shared.pending().remove(&id) {
                    let _ = done.send(Err(TransportError::Io {
                        op: "read the file window to send",
                        source,
                    }));
                }
            }
            Ok(())
        }
        Memory::Buffer(b) => {
            write_header(w, header).await?;
            write_buffer(w, &b, offset, slice.len).await
        }
    }
}

/// Sends `header` and, as its payload, its [`Header::payload_len`] bytes of `window`
/// from `offset` (a range the table or the registration checked against the window),
/// copied with `pread` a piece of at most [`STAGE_PIECE_BYTES`] at a time.
///
/// The first piece and the last byte of the range are read before anything is sent:
/// if either fails (the file no longer covers the range), nothing is sent and the read
/// error is returned as `Ok(Err(_))`, for the caller to answer in its own way. A read
/// that fails once the header is out (the file shrank meanwhile) cannot be reported in
/// the frame: it fails the connection.
async fn send_file_frame(
    w: &mut SockWriter,
    header: Header,
    window: &Arc<FileWindow>,
    offset: usize,
    staging: &mut Vec<u8>,
) -> Result<std::io::Result<()>, TransportError> {
    let len = header.payload_len() as usize;
    let first = len.min(STAGE_PIECE_BYTES);
    if len > first {
        if let Err(e) = stage(window.clone(), offset + len - 1, 1, staging).await {
            return Ok(Err(e));
        }
    }
    if let Err(e) = stage(window.clone(), offset, first, staging).await {
        return Ok(Err(e));
    }
    write_header(w, header).await?;
    w.write_all(staging).await.map_err(io("send payload"))?;
    let mut sent = first;
    while sent < len {
        let piece = (len - sent).min(STAGE_PIECE_BYTES);
        stage(window.clone(), offset + sent, piece, staging)
            .await
            .map_err(|source| TransportError::Io {
                op: "read the file window being sent",
                source,
            })?;
        w.write_all(staging).await.map_err(io("send payload"))?;
        sent += piece;
    }
    Ok(Ok(()))
}

/// Copies `len` bytes of `window` from `offset` into `staging` (resized to exactly
/// `len`, at most [`STAGE_PIECE_BYTES`]): what the page cache holds of its start right
/// here, the rest with `pread` on the blocking pool: the file may be slow to read, and
/// the writer must not stall a runtime thread.
async fn stage(
    window: Arc<FileWindow>,
    offset: usize,
    len: usize,
    staging: &mut Vec<u8>,
) -> std::io::Result<()> {
    debug_assert!(len <= STAGE_PIECE_BYTES);
    staging.resize(len, 0);
    // What the page cache holds of the piece's start is copied here; only the rest
    // is read on the blocking pool.
    let cached = window.read_cached_prefix(offset, staging);
    if cached == len {
        return Ok(());
    }
    let mut buf = std::mem::take(staging);
    let (buf, result) = tokio::task::spawn_blocking(move || {
        let r = window.read_at(offset + cached, &mut buf[cached..]);
        (buf, r)
    })
    .await
    .map_err(|e| std::io::Error::other(format!("file read task failed: {e}")))?;
    *staging = buf;
    result
}

/// Writes `len` bytes of a registered buffer from `offset`, straight from the memory
/// (no staging copy; large writes bypass the writer's buffer).
async fn write_buffer(
    w: &mut SockWriter,
    buffer: &Buffer,
    offset: usize,
    len: u32,
) -> Result<(), TransportError> {
    let range = offset..offset + len as usize;
    w.write_all(&buffer.read().await[range])
        .await
        .map_err(io("send payload"))
}
