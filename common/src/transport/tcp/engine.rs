//! The per-connection engine: a reader task and a writer task.
//!
//! The reader decodes frames. Control messages go to the application's queue; the
//! peer's READ/WRITE requests are served on the spot against the registration table
//! (a WRITE's payload is read straight into the granted buffer, a READ's answer is
//! queued for the writer with a reference to the granted memory); answers to our own
//! operations complete them. The writer serialises every outgoing frame and flushes
//! whenever its queue runs dry.
//!
//! Invariant: memory is only ever touched inside a range the table granted (peer
//! operations) or that the local caller registered and bounds-checked (own operations).
//!
//! File windows are never read through their mapping here: their bytes are copied with
//! `pread(2)` ([`FileWindow::read_at`]) into a staging buffer, at most
//! [`STAGE_PIECE_BYTES`] at a time; the first piece and the last byte of the range are
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

use std::sync::atomic::Ordering;
use std::sync::Arc;

use tokio::io::{AsyncReadExt, AsyncWriteExt, BufReader, BufWriter};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::sync::{mpsc, oneshot};

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
    let _ = shared.out.send(Outgoing::Shutdown);
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
    shared: &Shared,
    r: &mut BufReader<OwnedReadHalf>,
    ctrl: &CtrlTx,
) -> Result<(), TransportError> {
    let mut refusals = Refusals {
        peer: &shared.peer,
        count: 0,
    };
    while let Some(header) = read_header(r).await? {
        match header {
            Header::Ctrl { len } => {
                // `Header::parse` refused anything over MAX_CTRL_FRAME_BYTES; this side
                // may accept less.
                if len > shared.max_recv_ctrl {
                    return Err(TransportError::Protocol(format!(
                        "control frame of {len} bytes exceeds the {} this side accepts",
                        shared.max_recv_ctrl
                    )));
                }
                let mut msg = vec![0u8; len as usize];
                r.read_exact(&mut msg).await.map_err(io("read frame"))?;
                match ctrl.try_send(Ok(msg)) {
                    Ok(()) => {}
                    Err(mpsc::error::TrySendError::Full(_)) => {
                        return Err(TransportError::Protocol(format!(
                            "peer has more than {CTRL_QUEUE} control messages waiting to be taken"
                        )));
                    }
                    // The application dropped its end; keep serving one-sided ops.
                    Err(mpsc::error::TrySendError::Closed(_)) => {}
                }
            }
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
                let _ = shared.out.send(Outgoing::ReadResp { id, result });
            }
            Header::WriteReq { id, slice } => {
                count_served(shared)?;
                let RemoteSlice { rkey, addr, len } = slice;
                let status = match shared.table.check(Op::Write, rkey, addr, len) {
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
                        STATUS_OK
                    }
                    Err(fault) => {
                        refusals.log(Op::Write, slice, fault);
                        discard(r, u64::from(len)).await?;
                        wire::status_of(fault)
                    }
                };
                let _ = shared.out.send(Outgoing::WriteResp { id, status });
            }
            Header::ReadData { id, len } => {
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
            }
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

/// Writes queued frames until told to shut down or the socket fails.
pub(super) async fn writer(
    shared: Arc<Shared>,
    w: OwnedWriteHalf,
    mut queue: mpsc::UnboundedReceiver<Outgoing>,
) {
    let mut w = BufWriter::with_capacity(IO_BUF_BYTES, w);
    let mut staging = Vec::new();
    let result = write_loop(&shared, &mut w, &mut queue, &mut staging).await;
    if let Err(e) = &result {
        tracing::debug!(peer = %shared.peer, "transport writer stopped: {e}");
    }
    shared.fail_all();
    let _ = w.shutdown().await;
}

async fn write_loop(
    shared: &Shared,
    w: &mut BufWriter<OwnedWriteHalf>,
    queue: &mut mpsc::UnboundedReceiver<Outgoing>,
    staging: &mut Vec<u8>,
) -> Result<(), TransportError> {
    while let Some(frame) = queue.recv().await {
        match frame {
            Outgoing::Shutdown => {
                w.flush().await.map_err(io("flush"))?;
                return Ok(());
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
        }
    }
    Ok(())
}

async fn write_header(
    w: &mut BufWriter<OwnedWriteHalf>,
    header: Header,
) -> Result<(), TransportError> {
    let mut bytes = Vec::with_capacity(wire::MAX_HEADER_BYTES);
    header.encode(&mut bytes);
    w.write_all(&bytes).await.map_err(io("send"))
}

/// Answers a peer's READ. A granted file window whose range cannot be read (the file
/// shrank) is answered [`STATUS_UNREADABLE`] instead of data.
async fn send_read_resp(
    shared: &Shared,
    w: &mut BufWriter<OwnedWriteHalf>,
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
    w: &mut BufWriter<OwnedWriteHalf>,
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
    w: &mut BufWriter<OwnedWriteHalf>,
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
/// `len`, at most [`STAGE_PIECE_BYTES`]) with `pread`, on the blocking pool: the file
/// may be slow to read, and the writer must not stall a runtime thread.
async fn stage(
    window: Arc<FileWindow>,
    offset: usize,
    len: usize,
    staging: &mut Vec<u8>,
) -> std::io::Result<()> {
    debug_assert!(len <= STAGE_PIECE_BYTES);
    let mut buf = std::mem::take(staging);
    buf.resize(len, 0);
    let (buf, result) = tokio::task::spawn_blocking(move || {
        let r = window.read_at(offset, &mut buf);
        (buf, r)
    })
    .await
    .map_err(|e| std::io::Error::other(format!("file read task failed: {e}")))?;
    *staging = buf;
    result
}

/// Writes `len` bytes of a registered buffer from `offset`, straight from the memory
/// (no staging copy; large writes bypass the BufWriter's buffer).
async fn write_buffer(
    w: &mut BufWriter<OwnedWriteHalf>,
    buffer: &Buffer,
    offset: usize,
    len: u32,
) -> Result<(), TransportError> {
    let range = offset..offset + len as usize;
    w.write_all(&buffer.read().await[range])
        .await
        .map_err(io("send payload"))
}
