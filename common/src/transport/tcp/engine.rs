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
//! `pread(2)` ([`FileWindow::read_at`]) into a staging buffer before the frame that
//! carries them is started. A file truncated under a registered window therefore fails
//! that one operation (a peer's READ is answered with [`wire::STATUS_UNREADABLE`]; our
//! own WRITE completes with an I/O error) instead of raising SIGBUS and killing the
//! process; the connection goes on.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use tokio::io::{AsyncReadExt, AsyncWriteExt, BufReader, BufWriter};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::sync::{mpsc, oneshot};

use super::wire::{self, Header, Parsed, MAX_PEER_INFLIGHT_READS, STATUS_OK, STATUS_UNREADABLE};
use super::{Outgoing, Pending, Shared};
use crate::transport::{Buffer, FileWindow, Memory, Op, RemoteSlice, TransportError};

/// Socket buffer size for both directions: large enough that a chunk moves in few
/// system calls, small enough to be cheap per connection.
const IO_BUF_BYTES: usize = 256 << 10;

/// Largest staging buffer the writer keeps between frames; a larger one (a READ of a
/// whole big window) is freed once its frame is written.
const STAGING_KEEP_BYTES: usize = 16 << 20;

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
            tracing::debug!(peer = %shared.peer, "transport closed: {e}");
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

async fn read_loop(
    shared: &Shared,
    r: &mut BufReader<OwnedReadHalf>,
    ctrl: &CtrlTx,
) -> Result<(), TransportError> {
    while let Some(header) = read_header(r).await? {
        match header {
            Header::Ctrl { len } => {
                // `Header::parse` refused anything over MAX_CTRL_FRAME_BYTES.
                let mut msg = vec![0u8; len as usize];
                r.read_exact(&mut msg).await.map_err(io("read frame"))?;
                if ctrl.send(Ok(msg)).await.is_err() {
                    // The application dropped its end; keep serving one-sided ops.
                    continue;
                }
            }
            Header::ReadReq { id, slice } => {
                let RemoteSlice { rkey, addr, len } = slice;
                let inflight = shared.served_inflight.fetch_add(1, Ordering::SeqCst) + 1;
                if inflight > MAX_PEER_INFLIGHT_READS {
                    return Err(TransportError::Protocol(format!(
                        "peer has more than {MAX_PEER_INFLIGHT_READS} READs outstanding"
                    )));
                }
                let result = match shared.table.check(Op::Read, rkey, addr, len) {
                    Ok(g) => Ok((g.memory, g.offset, len)),
                    Err(fault) => {
                        tracing::warn!(peer = %shared.peer, rkey, addr, len, "refused peer READ: {fault}");
                        Err(wire::status_of(fault))
                    }
                };
                let _ = shared.out.send(Outgoing::ReadResp { id, result });
            }
            Header::WriteReq { id, slice } => {
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
                        tracing::warn!(peer = %shared.peer, rkey, addr, len, "refused peer WRITE: {fault}");
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
                write_header(w, Header::WriteResp { id, status }).await?;
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

/// Answers a peer's READ. A granted file window is staged with `pread` first; if that
/// fails (the file shrank), the answer is [`STATUS_UNREADABLE`] instead of data.
async fn send_read_resp(
    shared: &Shared,
    w: &mut BufWriter<OwnedWriteHalf>,
    id: u64,
    result: Result<(Memory, usize, u32), u8>,
    staging: &mut Vec<u8>,
) -> Result<(), TransportError> {
    let staged = match &result {
        Ok((Memory::File(f), offset, len)) => {
            match stage(f.clone(), *offset, *len, staging).await {
                Ok(()) => Ok(()),
                Err(e) => {
                    tracing::warn!(peer = %shared.peer, len, "cannot serve peer READ of a file window: {e}");
                    Err(STATUS_UNREADABLE)
                }
            }
        }
        Ok((Memory::Buffer(_), ..)) => Ok(()),
        Err(status) => Err(*status),
    };
    let (memory, offset, len) = match (staged, result) {
        (Ok(()), Ok(granted)) => granted,
        (Err(status), _) | (Ok(()), Err(status)) => {
            return write_header(w, Header::ReadRefused { id, status }).await;
        }
    };
    write_header(w, Header::ReadData { id, len }).await?;
    match memory {
        Memory::File(_) => {
            let sent = w.write_all(staging).await.map_err(io("send payload"));
            release_staging(staging);
            sent
        }
        Memory::Buffer(b) => write_buffer(w, &b, offset, len).await,
    }
}

/// Sends our own WRITE. A file-window source is staged with `pread` first; if that
/// fails, nothing is sent and the operation completes with the I/O error.
async fn send_write_req(
    shared: &Shared,
    w: &mut BufWriter<OwnedWriteHalf>,
    id: u64,
    slice: RemoteSlice,
    src: Memory,
    offset: usize,
    staging: &mut Vec<u8>,
) -> Result<(), TransportError> {
    match src {
        Memory::File(f) => {
            if let Err(source) = stage(f, offset, slice.len, staging).await {
                if let Some(Pending::Write { done, .. }) = shared.pending().remove(&id) {
                    let _ = done.send(Err(TransportError::Io {
                        op: "read the file window to send",
                        source,
                    }));
                }
                return Ok(());
            }
            write_header(w, Header::WriteReq { id, slice }).await?;
            let sent = w.write_all(staging).await.map_err(io("send payload"));
            release_staging(staging);
            sent
        }
        Memory::Buffer(b) => {
            write_header(w, Header::WriteReq { id, slice }).await?;
            write_buffer(w, &b, offset, slice.len).await
        }
    }
}

/// Copies `len` bytes of `window` from `offset` into `staging` (resized to exactly
/// `len`) with `pread`, on the blocking pool: the file may be slow to read, and the
/// writer must not stall a runtime thread. The range was checked against the window by
/// the table (peer READ) or by the registration (own WRITE).
async fn stage(
    window: Arc<FileWindow>,
    offset: usize,
    len: u32,
    staging: &mut Vec<u8>,
) -> std::io::Result<()> {
    let mut buf = std::mem::take(staging);
    buf.resize(len as usize, 0);
    let (buf, result) = tokio::task::spawn_blocking(move || {
        let r = window.read_at(offset, &mut buf);
        (buf, r)
    })
    .await
    .map_err(|e| std::io::Error::other(format!("file read task failed: {e}")))?;
    *staging = buf;
    result
}

/// Keeps a staging buffer for the next frame unless it grew unusually large.
fn release_staging(staging: &mut Vec<u8>) {
    if staging.capacity() > STAGING_KEEP_BYTES {
        *staging = Vec::new();
    }
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
