//! Files open for writing: a bounded write-back cache in registered buffers, pulled by
//! the server with one-sided READs and verified chunk by chunk before it touches disk.
//!
//! A [`WriteFile`] stands for one server file handle (`FileOpen`), shared by every
//! writable descriptor of one node on this mount. `write` copies the bytes into the
//! buffer being filled (one of the connection's [`WriteBufs`], registered for the
//! server's READs) and returns; a full buffer is *submitted*: its extents are hashed and
//! a `FileWrite` names them, and the server pulls, verifies and writes them. Reads of a
//! file open for writing go through the same handle (`FileRead`: the server pushes the
//! bytes into a registered buffer with a one-sided WRITE, with their hashes), after the
//! cache has been written back, so this mount never reads bytes older than its own
//! writes.
//!
//! Invariants:
//! - **Bounded**: the bytes not yet written back are at most the connection's buffers
//!   (`-o writeback=MIB`); a writer finding them all in flight waits.
//! - **Ordered**: two submissions of one file whose extents overlap are never in flight
//!   at once (the later waits), so the server applies overlapping writes in the order
//!   they were made; submissions that do not overlap run concurrently.
//! - **Deferred attributes** (`finish` sessions only): a mode or times set on a file
//!   that has not taken its name yet (nobody else can see it) wait in `pending` and
//!   reach the server before any request that could show or depend on them (fsync,
//!   another change, the last close), or with the close's `FileFinish`. A write after
//!   them drops a pending mtime: the server's write sets it, as a local write would.
//! - **Never silent**: a failed submission leaves its error on the file; every later
//!   `write`, `read`, `fsync`, `flush` (close) of the file fails with it. Nothing is
//!   retried on another connection: the server dropped the handle (and a staged file
//!   that never took its name) with the old connection.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use ferry_client::error::ClientError;
use ferry_client::files::OpenedFile;
use ferry_common::chunk::hash_chunk;
use ferry_common::msg::{
    Attr, Caller, Extent, HashAlgorithm, RegionDesc, SetAttrs, MAX_WRITE_EXTENTS,
};
use ferry_common::proto::conn::file_io_max;
use ferry_common::transport::{Access, Buffer, Memory, Registration, SharedTransport};
use fuser::Errno;
use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore};

use crate::remote::{errno_of, lock, Conn, OpError, Remote};

/// What a `fallocate` through a handle does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Allocation {
    /// Reserve the range (mode 0, or `FALLOC_FL_KEEP_SIZE`).
    Reserve {
        /// Leave the size as it is.
        keep_size: bool,
    },
    /// Punch a hole or zero the range (capability `falloc`).
    Change(ferry_common::msg::FallocMode),
}

impl Allocation {
    /// The allocation of `fallocate(2)`'s `mode`, if the mount supports it.
    pub fn of_mode(mode: i32) -> Option<Allocation> {
        use ferry_common::msg::FallocMode;
        use nix::libc::{FALLOC_FL_KEEP_SIZE, FALLOC_FL_PUNCH_HOLE, FALLOC_FL_ZERO_RANGE};
        Some(match mode {
            0 => Allocation::Reserve { keep_size: false },
            FALLOC_FL_KEEP_SIZE => Allocation::Reserve { keep_size: true },
            m if m == FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE => {
                Allocation::Change(FallocMode::PunchHole)
            }
            FALLOC_FL_ZERO_RANGE => Allocation::Change(FallocMode::ZeroRange { keep_size: false }),
            m if m == FALLOC_FL_ZERO_RANGE | FALLOC_FL_KEEP_SIZE => {
                Allocation::Change(FallocMode::ZeroRange { keep_size: true })
            }
            _ => return None,
        })
    }
}

/// Size of one write-back buffer: the most one `FileWrite` (or one `FileRead` through a
/// handle) moves, unless the server's chunk size makes that smaller.
pub const WRITE_BUF_BYTES: usize = 4 << 20;

/// The registered buffers one connection lends to written data.
pub struct WriteBufs {
    bufs: Vec<(Arc<Buffer>, Registration)>,
    free: Mutex<Vec<usize>>,
    slots: Arc<Semaphore>,
    /// Files holding a buffer they are filling, by address: when a writer finds no
    /// free buffer it has them submit theirs, so buffers held by files that stopped
    /// writing cannot starve it.
    fillers: Mutex<HashMap<usize, std::sync::Weak<WriteFile>>>,
    /// Bytes of each buffer used: `WRITE_BUF_BYTES`, or less for a server with small
    /// chunks ([`file_io_max`]).
    cap: usize,
}

/// A write-back buffer lent out of a [`WriteBufs`]; returned on drop.
pub struct WLease {
    bufs: Arc<WriteBufs>,
    index: usize,
    _permit: OwnedSemaphorePermit,
}

impl WLease {
    fn buffer(&self) -> &Arc<Buffer> {
        &self.bufs.bufs[self.index].0
    }

    /// The first `len` bytes of the buffer, as the server may address them.
    fn region(&self, len: usize) -> RegionDesc {
        let mut r = self.bufs.bufs[self.index].1.desc();
        r.len = len as u64;
        r
    }
}

impl Drop for WLease {
    fn drop(&mut self) {
        lock(&self.bufs.free).push(self.index);
    }
}

impl WriteBufs {
    /// `bytes` worth of buffers (at least two) registered on `transport` for the peer
    /// to READ and WRITE, each of at most `file_io_max(chunk_bytes)` bytes.
    pub fn new(
        transport: &SharedTransport,
        bytes: u64,
        chunk_bytes: u32,
    ) -> Result<Arc<WriteBufs>, String> {
        let cap = WRITE_BUF_BYTES.min(file_io_max(chunk_bytes) as usize);
        let count = (bytes / cap as u64).max(2) as usize;
        let mut bufs = Vec::with_capacity(count);
        for _ in 0..count {
            let buf = Buffer::new(cap).map_err(|e| format!("buffer: {e}"))?;
            let reg = transport
                .register(Memory::Buffer(buf.clone()), Access::RemoteWrite)
                .map_err(|e| format!("cannot register a write-back buffer: {e}"))?;
            bufs.push((buf, reg));
        }
        Ok(Arc::new(WriteBufs {
            bufs,
            free: Mutex::new((0..count).collect()),
            slots: Arc::new(Semaphore::new(count)),
            fillers: Mutex::new(HashMap::new()),
            cap,
        }))
    }

    fn lent(self: &Arc<Self>, permit: OwnedSemaphorePermit) -> WLease {
        let index = lock(&self.free)
            .pop()
            .expect("a permit guarantees a free buffer");
        WLease {
            bufs: self.clone(),
            index,
            _permit: permit,
        }
    }

    /// A free buffer for `me`. When there is none, every other file filling one
    /// submits it first (a writer waiting here holds no buffer it is filling, so
    /// buffers held by fillers always come back).
    async fn lease(self: &Arc<Self>, me: &Arc<WriteFile>) -> WLease {
        if let Ok(permit) = self.slots.clone().try_acquire_owned() {
            return self.lent(permit);
        }
        let others: Vec<Arc<WriteFile>> = lock(&self.fillers)
            .values()
            .filter_map(std::sync::Weak::upgrade)
            .filter(|f| !Arc::ptr_eq(f, me))
            .collect();
        for f in others {
            tokio::spawn(async move {
                let mut st = f.state.lock().await;
                f.submit(&mut st).await;
            });
        }
        let permit = self
            .slots
            .clone()
            .acquire_owned()
            .await
            .expect("the semaphore is never closed");
        self.lent(permit)
    }
}

/// The buffer being filled and the extents in it, in the order they were written.
struct Filling {
    lease: WLease,
    used: usize,
    extents: Vec<Extent>,
}

/// What is known of the file, for `getattr` while it is open.
#[derive(Clone)]
struct View {
    attr: Attr,
    /// The size as this mount's writes left it (written-back or not).
    size: u64,
}

/// How the file stands with the server.
enum Opened {
    /// Through this server handle.
    Handle(u64),
    /// Not yet: a file this mount created (`O_EXCL` or `O_TRUNC`), which nobody else
    /// can see before it takes its name. Its close sends it whole (`FilePut`) when
    /// its bytes never left the write-back buffer; anything needing a handle first
    /// opens it (`FileOpen`, staged).
    Deferred(Create),
    /// Written whole and named by a `FilePut`, no handle kept: a later need reopens it
    /// in place, if its name still holds the same server file.
    Put(Create, (u64, u64)),
}

/// A file this mount creates: where, with which mode, and whether the name must be
/// new.
#[derive(Clone)]
pub struct Create {
    /// Share name.
    pub share: String,
    /// Share-relative path.
    pub path: String,
    /// Permission bits.
    pub mode: u32,
    /// `O_EXCL`.
    pub exclusive: bool,
    /// Who created it: the server makes it as this caller when it makes it (see
    /// `ferry_client::posix`).
    pub caller: Option<Caller>,
}

struct State {
    opened: Opened,
    filling: Option<Filling>,
    /// Not yet given its name (see `Request::FileOpen`).
    staged: bool,
    /// Written since the last sync.
    dirty: bool,
    closed: bool,
    /// Attributes set but not yet sent (see the module docs): only on a staged file
    /// of a session with `finish`.
    pending: SetAttrs,
}

/// Submissions in flight: the byte ranges of each.
#[derive(Default)]
struct Flight {
    next: u64,
    live: HashMap<u64, Vec<(u64, u64)>>,
}

impl Flight {
    fn overlaps(&self, ranges: &[(u64, u64)]) -> bool {
        self.live
            .values()
            .flatten()
            .any(|&(s, e)| ranges.iter().any(|&(s2, e2)| s2 < e && s < e2))
    }
}

/// Records `len` bytes written at file offset `at`, which follow the bytes of
/// `extents` in the buffer: the last extent grows when they continue it within its
/// chunk, else new extents start. Extents are cut at the file's chunk boundaries
/// (multiples of `max`, the chunk size), so none exceeds a chunk and a file written
/// front to back arrives as whole chunks, whose hashes ferryd records as the file's
/// manifest when it commits it (`server/src/written.rs`).
fn append_extent(extents: &mut Vec<Extent>, mut at: u64, mut len: u64, max: u32) {
    let max = u64::from(max.max(1));
    while len > 0 {
        let room = max - at % max;
        let take = len.min(room);
        let extend = extents
            .last_mut()
            .filter(|last| last.offset + u64::from(last.len) == at && at % max != 0);
        match extend {
            Some(last) => last.len += take as u32,
            None => extents.push(Extent {
                offset: at,
                len: take as u32,
            }),
        }
        at += take;
        len -= take;
    }
}

/// One server file handle, shared by the writable descriptors of one node.
pub struct WriteFile {
    remote: Arc<Remote>,
    conn: Arc<Conn>,
    bufs: Arc<WriteBufs>,
    /// `share/path` at open, for messages.
    label: String,
    /// Largest extent: the server's chunk size.
    extent_max: u32,
    algorithm: HashAlgorithm,
    /// The session negotiated `finish`: a close is one `FileFinish`.
    finish: bool,
    timeout: Duration,
    state: tokio::sync::Mutex<State>,
    view: Mutex<View>,
    flight: Mutex<Flight>,
    landed: Notify,
    error: Mutex<Option<(Errno, String)>>,
    /// Descriptors of the node using this file.
    refs: AtomicUsize,
}

fn op_error(what: &str, e: &ClientError) -> OpError {
    OpError::new(errno_of(e), format!("{what}: {e}"))
}

impl WriteFile {
    /// The file `opened` on `conn` (one descriptor), its writes hashed in `algorithm`
    /// (the share's: [`ferry_client::client::Client::share_hash`]).
    pub fn new(
        remote: Arc<Remote>,
        conn: Arc<Conn>,
        label: String,
        opened: OpenedFile,
        algorithm: HashAlgorithm,
    ) -> Result<Arc<Self>, OpError> {
        let state = (Opened::Handle(opened.handle), opened.staged);
        Self::with(remote, conn, label, state, (opened.attr, algorithm))
    }

    /// A file this mount creates, not yet opened on the server (see [`Opened`]), with
    /// `attr` as its provisional attributes (size 0; a provisional key), its writes
    /// hashed in `algorithm` (the share's).
    pub fn deferred(
        remote: Arc<Remote>,
        conn: Arc<Conn>,
        create: Create,
        attr: Attr,
        algorithm: HashAlgorithm,
    ) -> Result<Arc<Self>, OpError> {
        let label = format!("{}/{}", create.share, create.path);
        let state = (Opened::Deferred(create), true);
        Self::with(remote, conn, label, state, (attr, algorithm))
    }

    fn with(
        remote: Arc<Remote>,
        conn: Arc<Conn>,
        label: String,
        (opened, staged): (Opened, bool),
        (attr, algorithm): (Attr, HashAlgorithm),
    ) -> Result<Arc<Self>, OpError> {
        let welcome = conn.client.welcome();
        let bufs = conn.write_bufs().cloned().ok_or_else(|| {
            OpError::new(Errno::EROFS, format!("{label}: the mount is read-only"))
        })?;
        Ok(Arc::new(WriteFile {
            timeout: remote.timeout(),
            remote,
            bufs,
            label,
            extent_max: welcome.chunk_bytes.max(1),
            algorithm,
            finish: conn.client.has_finish(),
            state: tokio::sync::Mutex::new(State {
                opened,
                filling: None,
                staged,
                dirty: false,
                closed: false,
                pending: SetAttrs::default(),
            }),
            view: Mutex::new(View {
                size: attr.size,
                attr,
            }),
            flight: Mutex::new(Flight::default()),
            landed: Notify::new(),
            error: Mutex::new(None),
            refs: AtomicUsize::new(1),
            conn,
        }))
    }

    /// The server handle, opening the file first if it has none (see [`Opened`]).
    async fn handle(&self, st: &mut State) -> Result<u64, OpError> {
        let (create, put) = match &st.opened {
            Opened::Handle(h) => return Ok(*h),
            Opened::Deferred(c) => (c.clone(), None),
            Opened::Put(c, key) => (c.clone(), Some(*key)),
        };
        let Create {
            share,
            path,
            mode,
            exclusive,
            caller,
        } = create;
        let opened = match put {
            // Created with O_EXCL or O_TRUNC: a new staged file, as `FileOpen` would
            // have made at create.
            None => {
                self.call("open", |c| async move {
                    let open = c
                        .client
                        .file_open(&share, &path, Some(mode), exclusive, true);
                    in_scope(caller, open).await
                })
                .await?
            }
            // Named already: the same file, in place.
            Some(key) => {
                let o = self
                    .call("reopen", |c| async move {
                        c.client.file_open(&share, &path, None, false, false).await
                    })
                    .await?;
                if (o.attr.dev, o.attr.ino) != key {
                    let handle = o.handle;
                    let _ = self
                        .call(
                            "close",
                            |c| async move { c.client.file_close(handle).await },
                        )
                        .await;
                    return Err(self.fail(OpError::new(
                        Errno::ESTALE,
                        format!(
                            "{}: the name holds another file since this one was closed",
                            self.label
                        ),
                    )));
                }
                o
            }
        };
        st.opened = Opened::Handle(opened.handle);
        st.staged = opened.staged;
        Ok(opened.handle)
    }

    /// The file's key in [`WriteBufs::fillers`].
    fn key(&self) -> usize {
        self as *const WriteFile as usize
    }

    /// One more descriptor uses the file.
    pub fn add_ref(&self) {
        self.refs.fetch_add(1, Ordering::AcqRel);
    }

    /// One descriptor fewer; true when it was the last.
    pub fn drop_ref(&self) -> bool {
        self.refs.fetch_sub(1, Ordering::AcqRel) == 1
    }

    /// The attributes as this mount sees them now (its unwritten bytes counted).
    pub fn attr(&self) -> Attr {
        let v = lock(&self.view).clone();
        let mut a = v.attr;
        a.size = v.size;
        a.blocks = a.blocks.max(v.size.div_ceil(512));
        a
    }

    /// Whether the file has not yet taken its name.
    pub async fn is_staged(&self) -> bool {
        self.state.lock().await.staged
    }

    fn check(&self) -> Result<(), OpError> {
        match &*lock(&self.error) {
            Some((errno, message)) => Err(OpError::new(*errno, message.clone())),
            None => Ok(()),
        }
    }

    fn fail(&self, e: OpError) -> OpError {
        let mut slot = lock(&self.error);
        if slot.is_none() {
            *slot = Some((e.errno, e.message.clone()));
        }
        e
    }

    /// Runs one request on the file's connection within the timeout; a lost
    /// connection is dropped (the next operation elsewhere reconnects) and, like every
    /// failure, left on the file.
    async fn call<T, F, Fut>(&self, what: &str, f: F) -> Result<T, OpError>
    where
        F: FnOnce(Arc<Conn>) -> Fut,
        Fut: std::future::Future<Output = Result<T, ClientError>>,
    {
        match tokio::time::timeout(self.timeout, f(self.conn.clone())).await {
            Ok(Ok(v)) => Ok(v),
            Ok(Err(e)) => {
                let mut err = op_error(&format!("{what} {}", self.label), &e);
                if crate::remote::is_fatal(&e) {
                    // The server's handle went with the connection: what was written
                    // and not yet made durable is lost, which is an I/O error.
                    self.remote.drop_conn(&self.conn, &e.to_string());
                    err.errno = Errno::EIO;
                }
                Err(self.fail(err))
            }
            Err(_) => {
                self.remote
                    .drop_conn(&self.conn, "no answer within the timeout");
                Err(self.fail(OpError::new(
                    Errno::EIO,
                    format!(
                        "{what} {}: no answer from {} within {:?}",
                        self.label,
                        self.remote.addr(),
                        self.timeout
                    ),
                )))
            }
        }
    }

    /// Copies `data` into the write-back cache at file offset `offset`.
    pub async fn write(self: &Arc<Self>, offset: u64, data: &[u8]) -> Result<(), OpError> {
        self.check()?;
        let mut st = self.state.lock().await;
        self.write_locked(&mut st, offset, data).await
    }

    /// Copies `data` into the write-back cache at the end of the file as this handle
    /// knows it (the server's size at the last open or revalidation, grown by this
    /// mount's writes): an `O_APPEND` write, whatever offset the kernel computed from
    /// its own cached size. Returns the offset written at. Appends through one handle
    /// are serialised by its state lock, so two never land on the same bytes.
    pub async fn append(self: &Arc<Self>, data: &[u8]) -> Result<u64, OpError> {
        self.check()?;
        let mut st = self.state.lock().await;
        let offset = lock(&self.view).size;
        self.write_locked(&mut st, offset, data).await?;
        Ok(offset)
    }

    /// Close-to-open at an open that finds this handle still held (another descriptor
    /// of this mount, or one whose release has not arrived yet): writes back what is
    /// cached, then asks the server for the file's attributes through the handle, so
    /// the size and times a later append or `getattr` uses are the server's, with
    /// every other client's close before this open in them. A file not yet named
    /// (created here, nobody else sees it) needs no revalidation.
    pub async fn revalidate(self: &Arc<Self>) -> Result<Attr, OpError> {
        self.check()?;
        let mut st = self.state.lock().await;
        if matches!(st.opened, Opened::Deferred(_)) || st.staged {
            return Ok(self.attr());
        }
        self.settle_all(&mut st).await?;
        let handle = self.handle(&mut st).await?;
        let attr = self
            .call("revalidate", |c| async move {
                c.client.file_set_attr(handle, SetAttrs::default()).await
            })
            .await?;
        Ok(self.settle(attr))
    }

    /// Before times are set by path (`SetTimes`) while this handle is open: what is
    /// cached is written back first, so no later write-back of bytes written before
    /// the change moves the mtime past it. False when the file has no name of its own
    /// on the server yet (staged, or not opened there): a change by path would miss it
    /// (or change the file it replaces), so its times must go with its handle.
    pub async fn ready_for_times(self: &Arc<Self>) -> Result<bool, OpError> {
        self.check()?;
        let mut st = self.state.lock().await;
        if matches!(st.opened, Opened::Deferred(_)) || st.staged {
            return Ok(false);
        }
        self.settle_all(&mut st).await?;
        Ok(true)
    }

    /// The times the server answered a change by path with (see
    /// [`WriteFile::ready_for_times`]): this handle's view shows them from now on.
    pub fn times_set(&self, attr: &Attr) {
        let mut v = lock(&self.view);
        v.attr.atime = attr.atime;
        v.attr.mtime = attr.mtime;
        v.attr.ctime = attr.ctime;
    }

    /// [`WriteFile::write`] with the state lock held.
    async fn write_locked(
        self: &Arc<Self>,
        st: &mut State,
        offset: u64,
        data: &[u8],
    ) -> Result<(), OpError> {
        if st.closed {
            return Err(OpError::new(
                Errno::EBADF,
                format!("{}: closed", self.label),
            ));
        }
        let mut done = 0usize;
        while done < data.len() {
            if st.filling.is_none() {
                let lease = self.bufs.lease(self).await;
                lock(&self.bufs.fillers).insert(self.key(), Arc::downgrade(self));
                st.filling = Some(Filling {
                    lease,
                    used: 0,
                    extents: Vec::new(),
                });
            }
            let f = st.filling.as_mut().expect("just filled");
            let n = (self.bufs.cap - f.used).min(data.len() - done);
            {
                let mut buf = f.lease.buffer().write().await;
                buf[f.used..f.used + n].copy_from_slice(&data[done..done + n]);
            }
            append_extent(
                &mut f.extents,
                offset + done as u64,
                n as u64,
                self.extent_max,
            );
            f.used += n;
            done += n;
            if f.used == self.bufs.cap || f.extents.len() >= MAX_WRITE_EXTENTS - 1 {
                self.submit(st).await;
            }
        }
        st.dirty = true;
        // The server's write sets the mtime now, as a local write would.
        st.pending.mtime = None;
        let mut v = lock(&self.view);
        v.size = v.size.max(offset + data.len() as u64);
        Ok(())
    }

    /// Sends the buffer being filled, once no submission in flight overlaps it; the
    /// write-back itself goes on in a task.
    async fn submit(self: &Arc<Self>, st: &mut State) {
        let Some(f) = self.take_filling(st) else {
            return;
        };
        let ranges: Vec<(u64, u64)> = f
            .extents
            .iter()
            .map(|e| (e.offset, e.offset + u64::from(e.len)))
            .collect();
        let id = loop {
            let landed = self.landed.notified();
            tokio::pin!(landed);
            landed.as_mut().enable();
            {
                let mut flight = lock(&self.flight);
                if !flight.overlaps(&ranges) {
                    let id = flight.next;
                    flight.next += 1;
                    flight.live.insert(id, ranges);
                    break id;
                }
            }
            landed.await;
        };
        let handle = self.handle(st).await;
        let me = self.clone();
        tokio::spawn(async move {
            // A failed open is on the file already; the buffer goes back.
            if let Ok(handle) = handle {
                let _ = me.send(handle, f).await;
            }
            lock(&me.flight).live.remove(&id);
            me.landed.notify_waiters();
        });
    }

    /// The buffer being filled, no longer offered to other writers.
    fn take_filling(&self, st: &mut State) -> Option<Filling> {
        let f = st.filling.take()?;
        lock(&self.bufs.fillers).remove(&self.key());
        Some(f)
    }

    /// The hash of each extent of `f`, in the session's algorithm.
    async fn hashes_of(&self, f: &Filling) -> Vec<ferry_common::msg::Hash256> {
        let buf = f.lease.buffer().read().await;
        let mut at = 0usize;
        f.extents
            .iter()
            .map(|e| {
                let h = hash_chunk(self.algorithm, &buf[at..at + e.len as usize]);
                at += e.len as usize;
                h
            })
            .collect()
    }

    async fn send(&self, handle: u64, f: Filling) -> Result<(), OpError> {
        if self.check().is_err() {
            return Ok(());
        }
        let region = f.lease.region(f.used);
        let hashes = self.hashes_of(&f).await;
        let (algorithm, extents) = (self.algorithm, f.extents);
        let size = self
            .call("write", |c| async move {
                c.client
                    .file_write(handle, region, algorithm, extents, hashes)
                    .await
            })
            .await?;
        drop(f.lease);
        let mut v = lock(&self.view);
        v.attr.size = size;
        Ok(())
    }

    /// Waits until every submission has landed.
    async fn drain(&self) {
        loop {
            let landed = self.landed.notified();
            tokio::pin!(landed);
            landed.as_mut().enable();
            if lock(&self.flight).live.is_empty() {
                return;
            }
            landed.await;
        }
    }

    /// Writes back everything cached; fails with the first write-back error.
    async fn write_all_back(self: &Arc<Self>, st: &mut State) -> Result<(), OpError> {
        self.submit(st).await;
        self.drain().await;
        self.check()
    }

    /// Sends the deferred attributes, if any (after the writes before them).
    async fn push_pending(&self, st: &mut State) -> Result<(), OpError> {
        if st.pending.is_empty() {
            return Ok(());
        }
        let handle = self.handle(st).await?;
        let attrs = std::mem::take(&mut st.pending);
        let attr = self
            .call("setattr", |c| async move {
                c.client.file_set_attr(handle, attrs).await
            })
            .await?;
        self.settle(attr);
        Ok(())
    }

    /// Everything cached written back, the deferred attributes sent.
    async fn settle_all(self: &Arc<Self>, st: &mut State) -> Result<(), OpError> {
        self.write_all_back(st).await?;
        self.push_pending(st).await
    }

    /// A close by the opener in one `FileFinish`: what is still cached, the deferred
    /// attributes and, for a staged file, its name. `None` when there is nothing to
    /// send.
    async fn finish(self: &Arc<Self>, st: &mut State) -> Result<Option<Attr>, OpError> {
        // Submissions in flight land first: the last extents may overlap them.
        self.drain().await;
        self.check()?;
        let filling = self.take_filling(st);
        let (commit, attrs) = (st.staged, std::mem::take(&mut st.pending));
        if filling.is_none() && !commit && attrs.is_empty() {
            return Ok(None);
        }
        let write = match &filling {
            Some(f) => Some((
                f.lease.region(f.used),
                f.extents.clone(),
                self.hashes_of(f).await,
            )),
            None => None,
        };
        let algorithm = self.algorithm;
        let attr = match &st.opened {
            Opened::Deferred(create) if self.finish => {
                // Nothing left the buffer: the whole file in one request.
                let c = create.clone();
                let attr = self
                    .call("close", |conn| async move {
                        let target = (c.share.as_str(), c.path.as_str(), c.mode, c.exclusive);
                        let put = conn.client.file_put(target, write, algorithm, attrs);
                        in_scope(c.caller.clone(), put).await
                    })
                    .await?;
                st.opened = Opened::Put(create.clone(), (attr.dev, attr.ino));
                attr
            }
            _ => {
                // Written again after a put (or never put): through a handle.
                let handle = self.handle(st).await?;
                let commit = st.staged;
                self.call("close", |c| async move {
                    c.client
                        .file_finish(handle, write, algorithm, attrs, commit)
                        .await
                })
                .await?
            }
        };
        // The server has read the buffer: it may be lent again.
        drop(filling);
        st.staged = false;
        Ok(Some(attr))
    }

    fn settle(&self, attr: Attr) -> Attr {
        let mut v = lock(&self.view);
        v.size = attr.size;
        v.attr = attr;
        drop(v);
        self.attr()
    }

    /// `fsync`: everything written back and durable on the server (a staged file then
    /// has its name). Returns the attributes after.
    pub async fn sync(self: &Arc<Self>, data_only: bool) -> Result<Attr, OpError> {
        self.check()?;
        let mut st = self.state.lock().await;
        self.settle_all(&mut st).await?;
        let handle = self.handle(&mut st).await?;
        let attr = self
            .call("fsync", |c| async move {
                c.client.file_sync(handle, data_only).await
            })
            .await?;
        st.staged = false;
        st.dirty = false;
        Ok(self.settle(attr))
    }

    /// `close` of one descriptor by its opener (FUSE `flush`): close-to-open, as NFS
    /// gives it. Everything is written back and a staged file takes its name; with
    /// `durable` (`-o sync_close`) the data is made durable first, as NFS's COMMIT
    /// does. Returns the attributes after.
    pub async fn flush(self: &Arc<Self>, durable: bool) -> Result<Attr, OpError> {
        self.check()?;
        let mut st = self.state.lock().await;
        if self.finish && !durable {
            return match self.finish(&mut st).await? {
                Some(attr) => Ok(self.settle(attr)),
                None => Ok(self.attr()),
            };
        }
        self.settle_all(&mut st).await?;
        let handle = self.handle(&mut st).await?;
        let attr = if durable && (st.dirty || st.staged) {
            let attr = self
                .call("close", |c| async move {
                    c.client.file_sync(handle, true).await
                })
                .await?;
            st.dirty = false;
            attr
        } else if st.staged {
            self.call(
                "close",
                |c| async move { c.client.file_commit(handle).await },
            )
            .await?
        } else {
            return Ok(self.attr());
        };
        st.staged = false;
        Ok(self.settle(attr))
    }

    /// Writes back everything cached (a close by a process other than the opener);
    /// returns the attributes as this mount sees them.
    pub async fn write_back(self: &Arc<Self>) -> Result<Attr, OpError> {
        self.check()?;
        let mut st = self.state.lock().await;
        self.write_all_back(&mut st).await?;
        Ok(self.attr())
    }

    /// The last descriptor is gone: writes back what is left and forgets the handle
    /// on the server (a staged file takes its name).
    pub async fn close(self: &Arc<Self>) -> Result<Attr, OpError> {
        let mut st = self.state.lock().await;
        st.closed = true;
        let untouched = st.filling.is_none() && st.pending.is_empty();
        match st.opened {
            // Put whole at its close and not written since: no handle to forget.
            Opened::Put(..) if untouched => return Ok(self.attr()),
            // Never closed by its opener, its bytes all in the buffer: sent whole now,
            // named as `FileClose` would have.
            Opened::Deferred(_) => {
                return match self.finish(&mut st).await? {
                    Some(attr) => Ok(self.settle(attr)),
                    None => Ok(self.attr()),
                };
            }
            _ => {}
        }
        if let Err(e) = self.settle_all(&mut st).await {
            // Nothing half-written takes a name: the server drops a staged file.
            if let Opened::Handle(handle) = st.opened {
                let _ = self
                    .call(
                        "discard",
                        |c| async move { c.client.file_discard(handle).await },
                    )
                    .await;
            }
            return Err(e);
        }
        let handle = self.handle(&mut st).await?;
        let attr = self
            .call(
                "close",
                |c| async move { c.client.file_close(handle).await },
            )
            .await?;
        st.staged = false;
        Ok(self.settle(attr))
    }

    /// Changes attributes through the handle, after writing back what is cached (so a
    /// size or time set now is not undone by an older write).
    pub async fn set_attr(self: &Arc<Self>, attrs: SetAttrs) -> Result<Attr, OpError> {
        self.check()?;
        let mut st = self.state.lock().await;
        let deferrable = attrs.size.is_none() && attrs.uid.is_none() && attrs.gid.is_none();
        if self.finish && st.staged && deferrable {
            // Nobody sees the file before it takes its name: the change goes with it.
            let p = &mut st.pending;
            p.mode = attrs.mode.or(p.mode);
            p.atime = attrs.atime.or(p.atime);
            p.mtime = attrs.mtime.or(p.mtime);
            let mut v = lock(&self.view);
            if let Some(mode) = attrs.mode {
                v.attr.mode = (v.attr.mode & !0o7777) | (mode & 0o7777);
            }
            v.attr.atime = attrs.atime.unwrap_or(v.attr.atime);
            v.attr.mtime = attrs.mtime.unwrap_or(v.attr.mtime);
            drop(v);
            return Ok(self.attr());
        }
        // Deferred attributes first, in the order they were set (a chown after a
        // chmod clears set-id bits, as it would have).
        self.settle_all(&mut st).await?;
        let handle = self.handle(&mut st).await?;
        let attr = self
            .call("setattr", |c| async move {
                c.client.file_set_attr(handle, attrs).await
            })
            .await?;
        st.dirty = true;
        Ok(self.settle(attr))
    }

    /// `fallocate` through the handle, after writing back what is cached (the range's
    /// pending bytes land first, so a hole or zeros are never undone by an older
    /// write; later writes queue behind it on the state lock).
    pub async fn allocate(
        self: &Arc<Self>,
        offset: u64,
        len: u64,
        how: Allocation,
    ) -> Result<Attr, OpError> {
        self.check()?;
        let mut st = self.state.lock().await;
        self.settle_all(&mut st).await?;
        let handle = self.handle(&mut st).await?;
        let attr = self
            .call("fallocate", |c| async move {
                match how {
                    Allocation::Reserve { keep_size } => {
                        c.client.file_allocate(handle, offset, len, keep_size).await
                    }
                    Allocation::Change(mode) => {
                        c.client.file_fallocate(handle, offset, len, mode).await
                    }
                }
            })
            .await?;
        st.dirty = true;
        Ok(self.settle(attr))
    }

    /// Reads `size` bytes at `offset` (fewer at the end of the file) through the
    /// handle, after writing back what is cached; every piece is checked against the
    /// hash the server sent with it.
    pub async fn read(self: &Arc<Self>, offset: u64, size: u32) -> Result<Vec<u8>, OpError> {
        self.check()?;
        let handle = {
            let mut st = self.state.lock().await;
            self.write_all_back(&mut st).await?;
            self.handle(&mut st).await?
        };
        let mut out = Vec::with_capacity(size as usize);
        let piece = u64::from(self.extent_max);
        while out.len() < size as usize {
            let at = offset + out.len() as u64;
            let want = (size as usize - out.len()).min(self.bufs.cap);
            let lease = self.bufs.lease(self).await;
            let region = lease.region(want);
            let got = self
                .call("read", |c| async move {
                    c.client.file_read(handle, at, region).await
                })
                .await?;
            let buf = lease.buffer().read().await;
            let data = &buf[..got.len as usize];
            let pieces = data.chunks(piece as usize);
            if pieces.len() != got.hashes.len()
                || pieces
                    .zip(&got.hashes)
                    .any(|(p, h)| hash_chunk(got.algorithm, p) != *h)
            {
                return Err(OpError::new(
                    Errno::EIO,
                    format!(
                        "read {}: bytes at {at} do not match the hashes the server sent",
                        self.label
                    ),
                ));
            }
            out.extend_from_slice(data);
            if (got.len as usize) < want {
                break;
            }
        }
        Ok(out)
    }
}

/// Runs `fut` as `caller`'s, if one is given.
async fn in_scope<F: std::future::Future>(caller: Option<Caller>, fut: F) -> F::Output {
    match caller {
        Some(c) => ferry_client::posix::as_caller(c, fut).await,
        None => fut.await,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ext(offset: u64, len: u32) -> Extent {
        Extent { offset, len }
    }

    #[test]
    fn consecutive_writes_grow_one_extent_up_to_the_chunk_boundary() {
        let mut e = Vec::new();
        append_extent(&mut e, 0, 4096, 1 << 20);
        append_extent(&mut e, 4096, 4096, 1 << 20);
        assert_eq!(e, vec![ext(0, 8192)]);
        // Past the chunk boundary a new extent starts.
        append_extent(&mut e, 8192, (1 << 20) - 8192 + 10, 1 << 20);
        assert_eq!(e, vec![ext(0, 1 << 20), ext(1 << 20, 10)]);
        // A write elsewhere (or backwards) is an extent of its own, even over the
        // same bytes: the server applies them in order.
        append_extent(&mut e, 0, 3, 1 << 20);
        assert_eq!(e.last(), Some(&ext(0, 3)));
        assert_eq!(e.len(), 3);
        // One large write is cut at the chunk boundaries, wherever it starts.
        let mut big = Vec::new();
        append_extent(&mut big, 100, 2500, 1000);
        assert_eq!(big, vec![ext(100, 900), ext(1000, 1000), ext(2000, 600)]);
        // Writes of odd sizes, front to back: whole chunks all the same.
        let mut odd = Vec::new();
        let mut at = 0;
        for len in [700, 700, 700, 333] {
            append_extent(&mut odd, at, len, 1000);
            at += len;
        }
        assert_eq!(odd, vec![ext(0, 1000), ext(1000, 1000), ext(2000, 433)]);
    }

    #[test]
    fn only_overlapping_write_backs_wait_for_each_other() {
        let mut f = Flight::default();
        f.live.insert(0, vec![(0, 4096), (8192, 12288)]);
        assert!(!f.overlaps(&[(4096, 8192)]), "the gap between two extents");
        assert!(
            !f.overlaps(&[(12288, 20000)]),
            "touching is not overlapping"
        );
        assert!(f.overlaps(&[(4095, 4097)]));
        assert!(f.overlaps(&[(100_000, 100_001), (9000, 9001)]));
        f.live.clear();
        assert!(!f.overlaps(&[(0, u64::MAX)]));
    }
}
