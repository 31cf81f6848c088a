//! A transport wrapper that encrypts and authenticates everything a session sends, on
//! any backend, without giving up one-sided data movement.
//!
//! [`Sealed`] starts in the clear (the handshake's `Hello` and `Welcome` pass through
//! untouched) and is armed with the session's keys ([`Sealed::arm`]) between the
//! `Welcome` and the next message. From then on:
//!
//! - **Control messages** are sealed records ([`crate::seal::ControlSealer`]): a frame
//!   altered, replayed, reordered or dropped on the way fails to open, and the
//!   connection ends with [`TransportError::Protocol`].
//! - **Registered memory is never exposed in the clear.** The application's
//!   registrations get this wrapper's rkeys; the inner transport registers them for
//!   local access only (a buffer, so that READs can land in it) or not at all (a file
//!   window). An injected READ or WRITE on the inner transport finds no plaintext.
//! - **READ** (`read(src, dst)`): this side asks the memory's owner with a `PULL`; the
//!   owner's wrapper (transport code, not the application: the same role as an RDMA
//!   NIC or the TCP engine) checks the rkey, bounds and access, seals the bytes into a
//!   scratch buffer that the inner transport exposes read-only, and answers `SEALED`
//!   with the piece's counter and tag. This side RDMA-READs the ciphertext straight
//!   into `dst`, opens it in place, and sends `RELEASE` so the scratch is reused.
//! - **WRITE** (`write(src, dst)`): this side seals `src` into its own scratch and
//!   sends `PUSH`; the owner of `dst` checks it, RDMA-READs the ciphertext into `dst`,
//!   opens it in place and answers `DONE`.
//!
//! So file data crosses the wire only as ciphertext, moved by the inner transport's
//! one-sided READs (as SMB 3.1.1 encrypts into the buffers it exposes over SMB
//! Direct), and a piece that does not open ends the connection before the
//! application sees a byte of it. Operations longer than [`PIECE_BYTES`] go in pieces,
//! each sealed under its own counter. The frame layout is in [`frame`].
//!
//! With key updates (capability `rekey`), each send first checks whether this side's
//! keys are due for the next generation (`UPDATE` ends the old control key), every
//! piece is sealed bound to the PULL's source or the PUSH's destination
//! ([`crate::seal::Binding`]) and announced with its generation, whose key the
//! receiver resolves as it reads the announcement; after each send, the data keys no
//! sealed piece holds any more are retired (`RETIRE`), in order, under the same lock.
//!
//! Limits that bound what a peer can make this side hold: at most
//! [`MAX_PIECES_IN_FLIGHT`] of this side's own pulls and pushes each, at most
//! [`MAX_PEER_PIECES`] of the peer's pulls and pushes being served (more closes the
//! connection), and at most [`MAX_UNREAD_MESSAGES`] application messages received but
//! not yet taken by [`Transport::recv`] (more closes it too: a session never has that
//! many requests or responses outstanding).
//!
//! Invariant the drivers keep: memory is registered only after the handshake (so
//! only after [`Sealed::arm`] on an encrypted session). A registration made before
//! `arm` is the inner transport's own and the peer's sealed operations cannot reach it.

pub mod frame;

use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use tokio::sync::{mpsc, oneshot, Semaphore};

use self::frame::{Frame, Piece};
use super::{
    Access, AccessFault, Buffer, Memory, Op, Registration, RemoteSlice, SharedTransport, Transport,
    TransportError, TransportKind,
};
use crate::codec::MAX_CTRL_FRAME_BYTES;
use crate::msg::RegionDesc;
use crate::seal::{
    Binding, ControlOpener, ControlSealer, DataOpener, DataSealer, PieceKey, SealedPiece,
    SessionKeys, Suite,
};

/// Most bytes sealed as one piece (and the size of each scratch buffer).
pub const PIECE_BYTES: usize = 1 << 20;

/// Most of this side's own pulls, and of its own pushes, in flight at once.
pub const MAX_PIECES_IN_FLIGHT: usize = 32;

/// Most of the peer's pulls and pushes this side serves at once; a peer that sends
/// more breaks the protocol and the connection is closed.
pub const MAX_PEER_PIECES: usize = 2 * MAX_PIECES_IN_FLIGHT;

/// Most application messages received and not yet taken by `recv` (the protocol
/// allows a few hundred outstanding requests; more is a broken or hostile peer).
pub const MAX_UNREAD_MESSAGES: usize = 4096;

/// How often each side sends an `ALIVE` record. A record dropped on the way makes the
/// next one fail to open, so a drop is noticed within this even when the
/// application has nothing to send.
pub const ALIVE_INTERVAL: Duration = Duration::from_secs(2);

/// How long a side waits for the peer's next record (its `ALIVE`s included) before it
/// ends the connection: frames withheld or a peer gone without a word.
pub const PEER_SILENCE_LIMIT: Duration = Duration::from_secs(30);

/// Pieces up to this size are opened on the async thread; longer ones on a blocking
/// thread.
const INLINE_OPEN_BYTES: usize = 64 << 10;

/// What a waiting pull or push is told.
enum Reply {
    /// The piece and its key, resolved when the answer was read (in stream order).
    Sealed(Piece, Arc<PieceKey>),
    Done,
    Fault(AccessFault),
}

/// One of the application's registrations, as this wrapper holds it.
struct Entry {
    memory: Memory,
    access: Access,
    /// The inner transport's local-only registration of a buffer (the destination of
    /// the READs that bring ciphertext into it); none for a file window.
    local: Option<Registration>,
}

type Table = Arc<Mutex<HashMap<u32, Arc<Entry>>>>;

/// The backend handle of a registration made by an armed wrapper: dropping it removes
/// the rkey from the table (pieces already being served hold their own reference).
struct Handle {
    rkey: u32,
    entry: Arc<Entry>,
    table: Table,
}

impl Drop for Handle {
    fn drop(&mut self) {
        lock(&self.table).remove(&self.rkey);
    }
}

/// A pre-registered scratch buffer the inner transport exposes read-only.
struct Scratch {
    buf: Arc<Buffer>,
    reg: Registration,
}

/// A free list of scratch buffers; its users bound how many exist.
struct ScratchPool {
    free: Mutex<Vec<Scratch>>,
}

impl ScratchPool {
    fn take(&self, inner: &SharedTransport) -> Result<Scratch, TransportError> {
        if let Some(s) = lock(&self.free).pop() {
            return Ok(s);
        }
        let buf = Buffer::new(PIECE_BYTES).map_err(|source| TransportError::Io {
            op: "allocating an encryption scratch buffer",
            source,
        })?;
        let reg = inner.register(Memory::Buffer(buf.clone()), Access::RemoteRead)?;
        Ok(Scratch { buf, reg })
    }

    fn put(&self, s: Scratch) {
        lock(&self.free).push(s);
    }
}

/// The state of an armed wrapper.
struct Armed {
    suite: Suite,
    /// Whether keys are updated (capability `rekey`): pieces carry their generation
    /// and associated data, registrations' rkeys are never reused.
    updates: bool,
    data_send: DataSealer,
    data_recv: DataOpener,
    app_rx: tokio::sync::Mutex<mpsc::UnboundedReceiver<Result<Vec<u8>, TransportError>>>,
    unread: AtomicUsize,
    waiters: Mutex<HashMap<u64, oneshot::Sender<Reply>>>,
    next_id: AtomicU64,
    next_rkey: AtomicU32,
    table: Table,
    pulls: Semaphore,
    pushes: Semaphore,
    /// Scratch sealed for the peer's pulls, until it releases them.
    serving: Mutex<HashMap<u64, Scratch>>,
    peer_pieces: AtomicUsize,
    serve_pool: ScratchPool,
    push_pool: ScratchPool,
}

/// The sending half of the control channel.
struct Sender {
    sealer: ControlSealer,
    /// The data key's generation when the control key was last updated: a
    /// direction's keys are updated together.
    data_generation: u32,
}

struct Shared {
    inner: SharedTransport,
    /// The control sealer (none until armed), held across sealing *and* sending so
    /// that records reach the wire in counter order.
    sealer: tokio::sync::Mutex<Option<Sender>>,
    armed: OnceLock<Armed>,
    /// Why the wrapper closed the connection, once it did.
    failed: Mutex<Option<String>>,
}

/// The wrapper; see the module docs.
pub struct Sealed {
    shared: Arc<Shared>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Sealed {
    /// `inner`, in the clear until [`Sealed::arm`].
    pub fn new(inner: SharedTransport) -> Arc<Sealed> {
        Arc::new(Sealed {
            shared: Arc::new(Shared {
                inner,
                sealer: tokio::sync::Mutex::new(None),
                armed: OnceLock::new(),
                failed: Mutex::new(None),
            }),
        })
    }

    /// Encrypts everything from now on with `keys`: sends after this call are sealed,
    /// and the next received frame must be the peer's first sealed one. Call between
    /// the handshake's last clear message and the next one, with no `send` or `recv`
    /// in progress, on a tokio runtime (it starts the task that receives). Fails if
    /// already armed or a send is in progress.
    pub fn arm(&self, keys: SessionKeys) -> Result<(), TransportError> {
        let mut sealer =
            self.shared.sealer.try_lock().map_err(|_| {
                TransportError::Local("encryption armed while a send was in progress")
            })?;
        if sealer.is_some() || self.shared.armed.get().is_some() {
            return Err(TransportError::Local("encryption armed twice"));
        }
        let (app_tx, app_rx) = mpsc::unbounded_channel();
        let armed = Armed {
            suite: keys.suite,
            updates: keys.control_send.updates(),
            data_send: keys.data_send,
            data_recv: keys.data_recv,
            app_rx: tokio::sync::Mutex::new(app_rx),
            unread: AtomicUsize::new(0),
            waiters: Mutex::new(HashMap::new()),
            next_id: AtomicU64::new(1),
            next_rkey: AtomicU32::new(1),
            table: Arc::new(Mutex::new(HashMap::new())),
            pulls: Semaphore::new(MAX_PIECES_IN_FLIGHT),
            pushes: Semaphore::new(MAX_PIECES_IN_FLIGHT),
            serving: Mutex::new(HashMap::new()),
            peer_pieces: AtomicUsize::new(0),
            serve_pool: ScratchPool {
                free: Mutex::new(Vec::new()),
            },
            push_pool: ScratchPool {
                free: Mutex::new(Vec::new()),
            },
        };
        if self.shared.armed.set(armed).is_err() {
            return Err(TransportError::Local("encryption armed twice"));
        }
        *sealer = Some(Sender {
            sealer: keys.control_send,
            data_generation: 0,
        });
        tokio::spawn(receive(self.shared.clone(), keys.control_recv, app_tx));
        tokio::spawn(keep_alive(Arc::downgrade(&self.shared)));
        Ok(())
    }

    /// The suite protecting the session, once armed.
    pub fn suite(&self) -> Option<Suite> {
        self.shared.armed.get().map(|a| a.suite)
    }
}

impl Shared {
    fn armed(&self) -> &Armed {
        // Only called on paths reached after `arm`.
        self.armed
            .get()
            .expect("sealed transport used as armed before arm()")
    }

    /// Seals `frame` as the next record and sends it.
    async fn send_frame(&self, frame: Frame) -> Result<(), TransportError> {
        self.send_holding(frame, None).await
    }

    /// Seals `frame` as the next record and sends it, then drops `hold` (the sealed
    /// piece `frame` announces). First updates this direction's control key if due;
    /// after, announces (in order, under the same lock as every announcement) the
    /// data keys that no sealed piece holds any more.
    async fn send_holding(
        &self,
        frame: Frame,
        hold: Option<SealedPiece>,
    ) -> Result<(), TransportError> {
        let mut sender = self.sealer.lock().await;
        let Some(s) = sender.as_mut() else {
            return Err(TransportError::Local("sealed frame before arm()"));
        };
        let now = Instant::now();
        self.update_if_due(s, now).await?;
        self.seal_and_send(s, now, frame).await?;
        drop(hold);
        if let Some(a) = self.armed.get() {
            while let Some(generation) = a.data_send.retired() {
                tracing::debug!(peer = %self.inner.peer(), generation, "retired a data key");
                self.seal_and_send(s, now, Frame::Retire { generation })
                    .await?;
            }
        }
        Ok(())
    }

    async fn seal_and_send(
        &self,
        s: &mut Sender,
        now: Instant,
        frame: Frame,
    ) -> Result<(), TransportError> {
        let record = s
            .sealer
            .seal(now, frame.encode())
            .map_err(|e| TransportError::Protocol(e.to_string()))?;
        if record.len() > MAX_CTRL_FRAME_BYTES {
            return Err(TransportError::Local("control message too long to seal"));
        }
        self.inner.send(record).await
    }

    /// Sends `UPDATE` (the last record under the current control key) and moves to the
    /// next control key, when this key's budget is spent or the data key moved on
    /// since the last update.
    async fn update_if_due(&self, s: &mut Sender, now: Instant) -> Result<(), TransportError> {
        let Some(a) = self.armed.get().filter(|a| a.updates) else {
            return Ok(());
        };
        let data = a.data_send.generation();
        if !s.sealer.update_due(now) && data == s.data_generation {
            return Ok(());
        }
        self.seal_and_send(s, now, Frame::Update).await?;
        s.sealer
            .update()
            .map_err(|e| TransportError::Protocol(e.to_string()))?;
        s.data_generation = data;
        tracing::info!(
            peer = %self.inner.peer(),
            control = s.sealer.generation(),
            data,
            "key update: this side now sends under new keys"
        );
        Ok(())
    }

    /// Ends the connection for `reason` (a broken rule or a record that did not
    /// authenticate): the application's next `recv` and every waiting operation fail.
    fn fail(&self, reason: String) {
        tracing::warn!(peer = %self.inner.peer(), "encrypted session failed: {reason}");
        lock(&self.failed).get_or_insert(reason);
        self.inner.close();
        if let Some(a) = self.armed.get() {
            lock(&a.waiters).clear();
        }
    }

    fn failure(&self) -> TransportError {
        match lock(&self.failed).clone() {
            Some(reason) => TransportError::Protocol(reason),
            None => TransportError::Closed,
        }
    }

    async fn wait(&self, id: u64, rx: oneshot::Receiver<Reply>) -> Result<Reply, TransportError> {
        let reply = rx.await;
        lock(&self.armed().waiters).remove(&id);
        reply.map_err(|_| self.failure())
    }

    fn waiter(&self) -> (u64, oneshot::Receiver<Reply>) {
        let a = self.armed();
        let id = a.next_id.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = oneshot::channel();
        lock(&a.waiters).insert(id, tx);
        (id, rx)
    }

    /// Reads one piece of the peer's memory (`src`, at most [`PIECE_BYTES`]) into
    /// `local` (an inner registration of `buf`) at `offset`, and opens it there.
    async fn pull(
        self: &Arc<Self>,
        src: RemoteSlice,
        local: &Registration,
        buf: &Arc<Buffer>,
        offset: usize,
    ) -> Result<(), TransportError> {
        let a = self.armed();
        let _permit = a
            .pulls
            .acquire()
            .await
            .map_err(|_| TransportError::Closed)?;
        let (id, rx) = self.waiter();
        self.send_frame(Frame::Pull { id, src }).await?;
        let (piece, key) = match self.wait(id, rx).await? {
            Reply::Sealed(piece, key) => (piece, key),
            Reply::Fault(fault) => {
                return Err(TransportError::RemoteAccess {
                    op: Op::Read,
                    fault,
                    rkey: src.rkey,
                    addr: src.addr,
                    len: src.len,
                })
            }
            Reply::Done => return Err(self.broken("DONE answered a PULL")),
        };
        let scratch = RemoteSlice {
            len: src.len,
            ..piece.scratch
        };
        let read = self.inner.read(scratch, local, offset).await;
        // The scratch is the owner's to reuse whatever happened.
        let _ = self.send_frame(Frame::Release { id }).await;
        read?;
        self.open_in(buf, offset, piece, key, binding(&src)).await
    }

    /// Opens the piece that just landed in `buf[offset..offset + at.len]`, bound to
    /// `at` (the owner's memory it came from or goes to).
    async fn open_in(
        self: &Arc<Self>,
        buf: &Arc<Buffer>,
        offset: usize,
        piece: Piece,
        key: Arc<PieceKey>,
        at: Binding,
    ) -> Result<(), TransportError> {
        let len = at.len as usize;
        let opened = if len <= INLINE_OPEN_BYTES {
            let mut bytes = buf.write().await;
            key.open(
                piece.counter,
                &at,
                &mut bytes[offset..offset + len],
                &piece.tag,
            )
        } else {
            let buf = buf.clone();
            tokio::task::spawn_blocking(move || {
                let mut bytes = buf.blocking_write();
                key.open(
                    piece.counter,
                    &at,
                    &mut bytes[offset..offset + len],
                    &piece.tag,
                )
            })
            .await
            .map_err(|_| TransportError::Local("opening task failed"))?
        };
        opened.map_err(|e| {
            let reason = e.to_string();
            self.fail(reason.clone());
            TransportError::Protocol(reason)
        })
    }

    /// Copies `memory[offset..offset + at.len]` into a scratch buffer of `pool` and
    /// seals it there, bound to `at`, on a blocking thread (the copy may read a file).
    async fn seal_into(
        self: &Arc<Self>,
        pool: &ScratchPool,
        memory: &Memory,
        offset: usize,
        at: Binding,
    ) -> Result<(Scratch, SealedPiece), SealFailure> {
        let len = at.len as usize;
        let scratch = pool.take(&self.inner).map_err(SealFailure::Transport)?;
        let (memory, buf, shared) = (memory.clone(), scratch.buf.clone(), self.clone());
        let sealed = tokio::task::spawn_blocking(move || {
            let mut out = buf.blocking_write();
            copy_out(&memory, offset, &mut out[..len]).map_err(SealFailure::Unreadable)?;
            shared
                .armed()
                .data_send
                .seal(Instant::now(), &at, &mut out[..len])
                .map_err(|e| SealFailure::Transport(TransportError::Protocol(e.to_string())))
        })
        .await
        .unwrap_or(Err(SealFailure::Transport(TransportError::Local(
            "sealing task failed",
        ))));
        match sealed {
            Ok(sealed) => Ok((scratch, sealed)),
            Err(e) => {
                pool.put(scratch);
                Err(e)
            }
        }
    }

    fn broken(&self, what: &str) -> TransportError {
        let reason = format!("peer broke the encrypted transport's rules: {what}");
        self.fail(reason.clone());
        TransportError::Protocol(reason)
    }
}

enum SealFailure {
    Transport(TransportError),
    Unreadable(std::io::Error),
}

/// Copies `memory[offset..offset + out.len()]` into `out` (a file window with
/// `pread`, so a truncated file fails instead of raising SIGBUS). Blocking.
fn copy_out(memory: &Memory, offset: usize, out: &mut [u8]) -> std::io::Result<()> {
    match memory {
        Memory::File(w) => w.read_at(offset, out),
        Memory::Buffer(b) => {
            let bytes = b.blocking_read();
            out.copy_from_slice(&bytes[offset..offset + out.len()]);
            Ok(())
        }
    }
}

/// Checks that `slice` lies inside `entry` and returns its offset there.
fn place(entry: &Entry, slice: &RemoteSlice) -> Result<usize, AccessFault> {
    let start = entry.memory.addr();
    let end = start + entry.memory.len() as u64;
    let last = slice
        .addr
        .checked_add(u64::from(slice.len))
        .ok_or(AccessFault::OutOfBounds)?;
    if slice.addr < start || last > end {
        return Err(AccessFault::OutOfBounds);
    }
    Ok((slice.addr - start) as usize)
}

/// Sends an `ALIVE` record every [`ALIVE_INTERVAL`] until the connection is closed
/// (a send fails) or the wrapper is gone.
async fn keep_alive(shared: Weak<Shared>) {
    loop {
        tokio::time::sleep(ALIVE_INTERVAL).await;
        let Some(shared) = shared.upgrade() else {
            return;
        };
        if shared.send_frame(Frame::Alive).await.is_err() {
            return;
        }
    }
}

/// The receiving task of an armed wrapper: opens every record, hands application
/// messages to `recv`, answers the peer's pulls and pushes and completes this side's.
async fn receive(
    shared: Arc<Shared>,
    mut opener: ControlOpener,
    app_tx: mpsc::UnboundedSender<Result<Vec<u8>, TransportError>>,
) {
    let outcome: Result<(), String> = loop {
        let record = match tokio::time::timeout(PEER_SILENCE_LIMIT, shared.inner.recv()).await {
            Ok(Ok(Some(r))) => r,
            Ok(Ok(None)) => break Ok(()),
            Ok(Err(e)) => break Err(e.to_string()),
            Err(_) => {
                break Err(format!(
                    "no record from the peer in {PEER_SILENCE_LIMIT:?}: frames withheld on the way, or the peer is gone"
                ))
            }
        };
        let plain = match opener.open(record) {
            Ok(p) => p,
            Err(e) => break Err(e.to_string()),
        };
        let Some(frame) = Frame::decode(plain) else {
            break Err("peer broke the encrypted transport's rules: malformed record".into());
        };
        if let Err(reason) = dispatch(&shared, frame, &app_tx, &mut opener) {
            break Err(reason);
        }
    };
    match outcome {
        Ok(()) => {
            // The peer closed: waiting operations fail, `recv` sees the end.
            if let Some(a) = shared.armed.get() {
                lock(&a.waiters).clear();
            }
        }
        Err(reason) => {
            shared.fail(reason);
            let _ = app_tx.send(Err(shared.failure()));
        }
    }
}

/// The key of an announced piece, resolved in stream order (before its generation
/// can be retired); `Err` ends the connection.
fn key_of(a: &Armed, piece: &Piece) -> Result<Arc<PieceKey>, String> {
    let generation = match (a.updates, piece.generation) {
        (true, Some(g)) => g,
        (false, None) => 0,
        _ => {
            return Err(
                "peer broke the encrypted transport's rules: a piece's key generation".into(),
            )
        }
    };
    a.data_recv.key(generation).map_err(|e| e.to_string())
}

/// The associated data of a piece of the owner's memory `s`.
fn binding(s: &RemoteSlice) -> Binding {
    Binding {
        rkey: s.rkey,
        addr: s.addr,
        len: s.len,
    }
}

/// Acts on one opened record; `Err` ends the connection. `opener` is the control
/// opener that opened it, updated by an `UPDATE`.
fn dispatch(
    shared: &Arc<Shared>,
    frame: Frame,
    app_tx: &mpsc::UnboundedSender<Result<Vec<u8>, TransportError>>,
    opener: &mut ControlOpener,
) -> Result<(), String> {
    let a = shared.armed();
    let complete = |id: u64, reply: Reply| -> Result<(), String> {
        match lock(&a.waiters).remove(&id) {
            Some(tx) => {
                let _ = tx.send(reply);
                Ok(())
            }
            None => Err(format!(
                "peer broke the encrypted transport's rules: answer to unknown operation {id}"
            )),
        }
    };
    match frame {
        Frame::App(bytes) => {
            if a.unread.fetch_add(1, Ordering::AcqRel) >= MAX_UNREAD_MESSAGES {
                return Err(format!(
                    "peer sent more than {MAX_UNREAD_MESSAGES} control messages that were not read"
                ));
            }
            let _ = app_tx.send(Ok(bytes));
            Ok(())
        }
        Frame::Alive => Ok(()),
        Frame::Update => {
            opener.update().map_err(|e| e.to_string())?;
            tracing::info!(peer = %shared.inner.peer(), "key update: the peer now sends under new keys");
            Ok(())
        }
        Frame::Retire { generation } => a.data_recv.retire(generation).map_err(|e| e.to_string()),
        Frame::Sealed { id, piece } => {
            let key = key_of(a, &piece)?;
            complete(id, Reply::Sealed(piece, key))
        }
        Frame::Done { id } => complete(id, Reply::Done),
        Frame::Fault { id, fault } => complete(id, Reply::Fault(fault)),
        Frame::Release { id } => match lock(&a.serving).remove(&id) {
            Some(scratch) => {
                a.serve_pool.put(scratch);
                a.peer_pieces.fetch_sub(1, Ordering::AcqRel);
                Ok(())
            }
            None => Err(format!(
                "peer broke the encrypted transport's rules: release of unknown piece {id}"
            )),
        },
        Frame::Pull { id, src } => {
            admit_peer_piece(a, src.len)?;
            tokio::spawn(serve_pull(shared.clone(), id, src));
            Ok(())
        }
        Frame::Push { id, piece, dst } => {
            admit_peer_piece(a, dst.len)?;
            let key = key_of(a, &piece)?;
            tokio::spawn(serve_push(shared.clone(), id, piece, key, dst));
            Ok(())
        }
    }
}

fn admit_peer_piece(a: &Armed, len: u32) -> Result<(), String> {
    if len as usize > PIECE_BYTES {
        return Err(format!(
            "peer broke the encrypted transport's rules: a piece of {len} bytes (most {PIECE_BYTES})"
        ));
    }
    if a.peer_pieces.fetch_add(1, Ordering::AcqRel) >= MAX_PEER_PIECES {
        return Err(format!(
            "peer broke the encrypted transport's rules: more than {MAX_PEER_PIECES} pieces at once"
        ));
    }
    Ok(())
}

/// The entry `rkey` names, if it grants `access`; else the fault to answer.
fn lookup(a: &Armed, slice: &RemoteSlice, write: bool) -> Result<(Arc<Entry>, usize), AccessFault> {
    let entry = lock(&a.table)
        .get(&slice.rkey)
        .cloned()
        .ok_or(AccessFault::InvalidRkey)?;
    let offset = place(&entry, slice)?;
    let allowed = if write {
        entry.access.remote_write()
    } else {
        entry.access.remote_read()
    };
    if !allowed {
        return Err(AccessFault::Denied);
    }
    Ok((entry, offset))
}

/// Answers the peer's `PULL` of this side's memory.
async fn serve_pull(shared: Arc<Shared>, id: u64, src: RemoteSlice) {
    let a = shared.armed();
    let mut hold = None;
    let answer = match lookup(a, &src, false) {
        Err(fault) => Frame::Fault { id, fault },
        Ok((entry, offset)) => {
            match shared
                .seal_into(&a.serve_pool, &entry.memory, offset, binding(&src))
                .await
            {
                Ok((scratch, sealed)) => {
                    let piece = Piece {
                        scratch: RemoteSlice {
                            len: 0,
                            ..slice_of(&scratch)
                        },
                        counter: sealed.counter,
                        tag: sealed.tag,
                        generation: a.updates.then(|| sealed.generation()),
                    };
                    hold = Some(sealed);
                    lock(&a.serving).insert(id, scratch);
                    Frame::Sealed { id, piece }
                }
                Err(SealFailure::Unreadable(e)) => {
                    tracing::warn!(peer = %shared.inner.peer(), "cannot read registered memory for a pull: {e}");
                    Frame::Fault {
                        id,
                        fault: AccessFault::Refused,
                    }
                }
                Err(SealFailure::Transport(e)) => {
                    shared.fail(format!("cannot seal a piece: {e}"));
                    return;
                }
            }
        }
    };
    if matches!(answer, Frame::Fault { .. }) {
        a.peer_pieces.fetch_sub(1, Ordering::AcqRel);
    }
    let _ = shared.send_holding(answer, hold).await;
}

/// Answers the peer's `PUSH` into this side's memory.
async fn serve_push(
    shared: Arc<Shared>,
    id: u64,
    piece: Piece,
    key: Arc<PieceKey>,
    dst: RemoteSlice,
) {
    let a = shared.armed();
    let answer = match lookup(a, &dst, true) {
        Err(fault) => Frame::Fault { id, fault },
        Ok((entry, offset)) => match (&entry.local, &entry.memory) {
            (Some(local), Memory::Buffer(buf)) => {
                let scratch = RemoteSlice {
                    len: dst.len,
                    ..piece.scratch
                };
                match shared.inner.read(scratch, local, offset).await {
                    Err(e) => {
                        tracing::debug!(peer = %shared.inner.peer(), "cannot read a pushed piece: {e}");
                        Frame::Fault {
                            id,
                            fault: AccessFault::Refused,
                        }
                    }
                    Ok(()) => match shared.open_in(buf, offset, piece, key, binding(&dst)).await {
                        Ok(()) => Frame::Done { id },
                        // `open_in` ended the connection.
                        Err(_) => return,
                    },
                }
            }
            _ => Frame::Fault {
                id,
                fault: AccessFault::Denied,
            },
        },
    };
    a.peer_pieces.fetch_sub(1, Ordering::AcqRel);
    let _ = shared.send_frame(answer).await;
}

/// A fresh rkey for a registration. With key updates an rkey is never reused in a
/// session (pieces are bound to it), so the session fails to register after 2^32 - 1
/// registrations; without, rkeys wrap and skip 0 and those in use.
fn next_rkey(a: &Armed, table: &HashMap<u32, Arc<Entry>>) -> Result<u32, TransportError> {
    if a.updates {
        return a
            .next_rkey
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |r| r.checked_add(1))
            .map_err(|_| {
                TransportError::Local("this session has used every registration key: reconnect")
            });
    }
    loop {
        let rkey = a.next_rkey.fetch_add(1, Ordering::Relaxed);
        if rkey != 0 && !table.contains_key(&rkey) {
            return Ok(rkey);
        }
    }
}

fn slice_of(s: &Scratch) -> RemoteSlice {
    let d = s.reg.desc();
    RemoteSlice {
        rkey: d.rkey,
        addr: d.addr,
        len: 0,
    }
}

/// The pieces `(offset, len)` of an operation of `len` bytes.
fn pieces(len: u32) -> impl Iterator<Item = (u32, u32)> {
    let step = PIECE_BYTES as u32;
    (0..len.div_ceil(step).max(1)).map(move |i| {
        let off = i * step;
        (off, (len - off).min(step))
    })
}

#[async_trait]
impl Transport for Sealed {
    fn kind(&self) -> TransportKind {
        self.shared.inner.kind()
    }

    fn peer(&self) -> String {
        self.shared.inner.peer()
    }

    fn device(&self) -> Option<String> {
        self.shared.inner.device()
    }

    fn register(&self, memory: Memory, access: Access) -> Result<Registration, TransportError> {
        let Some(a) = self.shared.armed.get() else {
            return self.shared.inner.register(memory, access);
        };
        if access.remote_write() && !memory.is_writable() {
            return Err(TransportError::Local(
                "only buffers can be registered for remote writes",
            ));
        }
        let local = match &memory {
            Memory::Buffer(_) => Some(self.shared.inner.register(memory.clone(), Access::Local)?),
            Memory::File(_) => None,
        };
        let entry = Arc::new(Entry {
            memory: memory.clone(),
            access,
            local,
        });
        let rkey = {
            let mut table = lock(&a.table);
            let rkey = next_rkey(a, &table)?;
            table.insert(rkey, entry.clone());
            rkey
        };
        let desc = RegionDesc {
            addr: memory.addr(),
            len: memory.len() as u64,
            rkey,
        };
        let handle = Handle {
            rkey,
            entry,
            table: a.table.clone(),
        };
        Ok(Registration::new(desc, memory, access, Box::new(handle)))
    }

    async fn read(
        &self,
        src: RemoteSlice,
        dst: &Registration,
        dst_offset: usize,
    ) -> Result<(), TransportError> {
        if self.shared.armed.get().is_none() {
            return self.shared.inner.read(src, dst, dst_offset).await;
        }
        let buf = dst.read_destination(dst_offset, src.len)?.clone();
        let local = match dst.backend::<Handle>() {
            Some(h) => h
                .entry
                .local
                .as_ref()
                .ok_or(TransportError::Local("READ destination must be a buffer"))?,
            // Registered before arm(): the inner transport's own registration.
            None => dst,
        };
        for (off, len) in pieces(src.len) {
            let piece = RemoteSlice {
                rkey: src.rkey,
                addr: src.addr + u64::from(off),
                len,
            };
            self.shared
                .pull(piece, local, &buf, dst_offset + off as usize)
                .await?;
        }
        Ok(())
    }

    async fn write(
        &self,
        src: &Registration,
        src_offset: usize,
        dst: RemoteSlice,
    ) -> Result<(), TransportError> {
        let Some(a) = self.shared.armed.get() else {
            return self.shared.inner.write(src, src_offset, dst).await;
        };
        src.check_write_source(src_offset, dst.len)?;
        for (off, len) in pieces(dst.len) {
            let _permit = a
                .pushes
                .acquire()
                .await
                .map_err(|_| TransportError::Closed)?;
            let target = RemoteSlice {
                rkey: dst.rkey,
                addr: dst.addr + u64::from(off),
                len,
            };
            let (scratch, sealed) = match self
                .shared
                .seal_into(
                    &a.push_pool,
                    src.memory(),
                    src_offset + off as usize,
                    binding(&target),
                )
                .await
            {
                Ok(sealed) => sealed,
                Err(SealFailure::Transport(e)) => return Err(e),
                Err(SealFailure::Unreadable(e)) => {
                    return Err(TransportError::Io {
                        op: "reading a WRITE's source",
                        source: e,
                    })
                }
            };
            let piece = Piece {
                scratch: RemoteSlice {
                    len,
                    ..slice_of(&scratch)
                },
                counter: sealed.counter,
                tag: sealed.tag,
                generation: a.updates.then(|| sealed.generation()),
            };
            let (id, rx) = self.shared.waiter();
            let push = Frame::Push {
                id,
                piece,
                dst: target,
            };
            let sent = self.shared.send_holding(push, Some(sealed)).await;
            let reply = match sent {
                Ok(()) => self.shared.wait(id, rx).await,
                Err(e) => Err(e),
            };
            a.push_pool.put(scratch);
            match reply? {
                Reply::Done => {}
                Reply::Fault(fault) => {
                    return Err(TransportError::RemoteAccess {
                        op: Op::Write,
                        fault,
                        rkey: target.rkey,
                        addr: target.addr,
                        len,
                    })
                }
                Reply::Sealed(..) => return Err(self.shared.broken("SEALED answered a PUSH")),
            }
        }
        Ok(())
    }

    async fn send(&self, msg: Vec<u8>) -> Result<(), TransportError> {
        if self.shared.armed.get().is_none() {
            return self.shared.inner.send(msg).await;
        }
        self.shared.send_frame(Frame::App(msg)).await
    }

    async fn recv(&self) -> Result<Option<Vec<u8>>, TransportError> {
        let Some(a) = self.shared.armed.get() else {
            return self.shared.inner.recv().await;
        };
        let mut rx = a.app_rx.lock().await;
        match rx.recv().await {
            Some(Ok(bytes)) => {
                a.unread.fetch_sub(1, Ordering::AcqRel);
                Ok(Some(bytes))
            }
            Some(Err(e)) => Err(e),
            None => match lock(&self.shared.failed).clone() {
                Some(reason) => Err(TransportError::Protocol(reason)),
                None => Ok(None),
            },
        }
    }

    fn close(&self) {
        self.shared.inner.close();
    }
}

#[cfg(test)]
mod tests;
