//! The connection to ferryd: connect, reconnect after the server went away, a bound on
//! every call, and the registered buffers one-sided reads land in.
//!
//! Invariant: a [`Conn`]'s buffers are registered with that connection's transport
//! and are used only for READs on it; a region descriptor from the server is used only
//! on the connection that received it (the rkeys belong to that connection's
//! protection domain on RDMA).

use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use ferry_client::error::ClientError;
use ferry_client::{Client, Credentials};
use ferry_common::codec::CodecError;
use ferry_common::msg::{ErrorKind, RegionDesc};
use ferry_common::transport::{
    Access, Buffer, Memory, Registration, RemoteSlice, TransportChoice, TransportError,
};
use fuser::Errno;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::writer::WriteBufs;

/// Most bytes one RDMA READ fetches: a run of consecutive chunks, or one chunk. Also
/// the size of each registered fetch buffer, and so the largest chunk size a mount uses.
pub const FETCH_BYTES: usize = 1 << 20;

/// Registered buffers per connection: the most one-sided reads in flight at once.
pub const FETCH_BUFFERS: usize = 16;

/// Why an operation failed, with the errno the kernel gets.
#[derive(Debug, thiserror::Error)]
#[error("{message}")]
pub struct OpError {
    /// The errno returned to the caller.
    pub errno: Errno,
    /// What happened, for the log.
    pub message: String,
}

impl OpError {
    /// An error with an errno and a message.
    pub fn new(errno: Errno, message: impl Into<String>) -> OpError {
        OpError {
            errno,
            message: message.into(),
        }
    }
}

/// The errno for a client error.
pub fn errno_of(e: &ClientError) -> Errno {
    match e {
        ClientError::Remote(r) => match r.kind {
            ErrorKind::NotFound | ErrorKind::NoSuchShare => Errno::ENOENT,
            ErrorKind::PermissionDenied | ErrorKind::OutsideShare => Errno::EACCES,
            ErrorKind::ReadOnly => Errno::EROFS,
            ErrorKind::NoSpace => Errno::ENOSPC,
            ErrorKind::NotADirectory => Errno::ENOTDIR,
            ErrorKind::IsADirectory => Errno::EISDIR,
            ErrorKind::InvalidPath => Errno::EINVAL,
            ErrorKind::Exists => Errno::EEXIST,
            ErrorKind::Busy => Errno::EBUSY,
            ErrorKind::TooManyLinks => Errno::EMLINK,
            ErrorKind::NotEmpty => Errno::ENOTEMPTY,
            ErrorKind::QuotaExceeded => Errno::EDQUOT,
            ErrorKind::Unsupported => Errno::EOPNOTSUPP,
            ErrorKind::FileTooBig => Errno::EFBIG,
            ErrorKind::Invalid => Errno::EINVAL,
            ErrorKind::NoAttribute => Errno::ENODATA,
            ErrorKind::AttributeTooBig => Errno::E2BIG,
            ErrorKind::AuthRequired | ErrorKind::AuthFailed => Errno::EACCES,
            _ => Errno::EIO,
        },
        ClientError::Disconnected(_)
        | ClientError::Connect { .. }
        | ClientError::Hung { .. }
        | ClientError::Stalled { .. } => Errno::ENOTCONN,
        ClientError::Limit(CodecError::Limit { field, .. }) if is_path_field(field) => {
            Errno::ENAMETOOLONG
        }
        ClientError::Limit(_) => Errno::EINVAL,
        _ => Errno::EIO,
    }
}

/// Whether a request field the codec limits is a path or a name (too long:
/// `ENAMETOOLONG`).
fn is_path_field(field: &str) -> bool {
    matches!(
        field,
        "path" | "from" | "to" | "base" | "target" | "symlink_target" | "name"
    )
}

/// True if the error means the connection is gone (so the next call reconnects).
pub fn is_fatal(e: &ClientError) -> bool {
    matches!(
        e,
        ClientError::Disconnected(_)
            | ClientError::Hung { .. }
            | ClientError::Stalled { .. }
            | ClientError::Transport(_)
            | ClientError::Protocol(_)
            | ClientError::Connect { .. }
            | ClientError::Handshake { .. }
    )
}

/// One live connection and its registered fetch buffers.
pub struct Conn {
    /// The session.
    pub client: Client,
    /// This connection's number: each connection of a [`Remote`] gets the next one, so
    /// state tied to the server's session (file locks) can tell it outlived it.
    pub id: u64,
    /// Write-back buffers; `None` on a read-only mount.
    wbufs: Option<Arc<WriteBufs>>,
    bufs: Vec<(Arc<Buffer>, Registration)>,
    free: Mutex<Vec<usize>>,
    slots: Arc<Semaphore>,
}

/// A fetch buffer lent out of a [`Conn`]; returned on drop.
pub struct Lease<'a> {
    conn: &'a Conn,
    index: usize,
    _permit: OwnedSemaphorePermit,
}

impl Lease<'_> {
    /// The registration a READ lands in.
    pub fn reg(&self) -> &Registration {
        &self.conn.bufs[self.index].1
    }

    /// The buffer itself.
    pub fn buffer(&self) -> &Arc<Buffer> {
        &self.conn.bufs[self.index].0
    }
}

impl Drop for Lease<'_> {
    fn drop(&mut self) {
        lock(&self.conn.free).push(self.index);
    }
}

impl Conn {
    /// The write-back buffers, on a writable mount.
    pub fn write_bufs(&self) -> Option<&Arc<WriteBufs>> {
        self.wbufs.as_ref()
    }

    fn new(client: Client, id: u64, writeback_bytes: u64) -> Result<Conn, String> {
        let wbufs = if writeback_bytes > 0 && client.can_write() {
            Some(WriteBufs::new(
                client.transport(),
                writeback_bytes,
                client.welcome().chunk_bytes,
            )?)
        } else {
            None
        };
        let mut bufs = Vec::with_capacity(FETCH_BUFFERS);
        for _ in 0..FETCH_BUFFERS {
            let buf = Buffer::new(FETCH_BYTES).map_err(|e| format!("buffer: {e}"))?;
            let reg = client
                .transport()
                .register(Memory::Buffer(buf.clone()), Access::Local)
                .map_err(|e| format!("cannot register a read buffer: {e}"))?;
            bufs.push((buf, reg));
        }
        Ok(Conn {
            client,
            id,
            wbufs,
            bufs,
            free: Mutex::new((0..FETCH_BUFFERS).collect()),
            slots: Arc::new(Semaphore::new(FETCH_BUFFERS)),
        })
    }

    /// Waits for a free fetch buffer.
    pub async fn lease(&self) -> Lease<'_> {
        let permit = self
            .slots
            .clone()
            .acquire_owned()
            .await
            .expect("the semaphore is never closed");
        let index = lock(&self.free)
            .pop()
            .expect("a permit guarantees a free buffer");
        Lease {
            conn: self,
            index,
            _permit: permit,
        }
    }

    /// RDMA READ of `len` bytes at `offset` of the server's `region` into the lease's
    /// buffer at 0.
    pub async fn read(
        &self,
        region: &RegionDesc,
        offset: u64,
        len: u32,
        into: &Lease<'_>,
    ) -> Result<(), TransportError> {
        let src = RemoteSlice::of(region, offset, len).ok_or(TransportError::Local(
            "read outside the server's advertised region",
        ))?;
        self.client.transport().read(src, into.reg(), 0).await
    }
}

/// Where to connect, and the current connection.
pub struct Remote {
    host: String,
    port: u16,
    choice: TransportChoice,
    credentials: Credentials,
    timeout: Duration,
    /// Bytes of write-back buffers each connection registers (0: a read-only mount).
    writeback_bytes: u64,
    current: Mutex<Option<Arc<Conn>>>,
    connecting: tokio::sync::Mutex<()>,
    /// Connections made so far (the last one's [`Conn::id`]).
    connects: std::sync::atomic::AtomicU64,
}

impl Remote {
    /// A remote, not yet connected; every connection proves `credentials` and, on a
    /// writable mount, registers `writeback_bytes` of write-back buffers.
    pub fn new(
        host: String,
        port: u16,
        choice: TransportChoice,
        credentials: Credentials,
        timeout: Duration,
        writeback_bytes: u64,
    ) -> Remote {
        Remote {
            host,
            port,
            choice,
            credentials,
            timeout,
            writeback_bytes,
            current: Mutex::new(None),
            connecting: tokio::sync::Mutex::new(()),
            connects: std::sync::atomic::AtomicU64::new(0),
        }
    }

    /// The per-operation bound.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// `host:port`, for logs.
    pub fn addr(&self) -> String {
        if self.host.contains(':') {
            format!("[{}]:{}", self.host, self.port)
        } else {
            format!("{}:{}", self.host, self.port)
        }
    }

    /// The live connection, if there is one (no connecting).
    pub fn current(&self) -> Option<Arc<Conn>> {
        lock(&self.current).clone()
    }

    /// The live connection, connecting (again) if there is none.
    pub async fn conn(&self) -> Result<Arc<Conn>, OpError> {
        if let Some(c) = lock(&self.current).clone() {
            return Ok(c);
        }
        let _one = self.connecting.lock().await;
        if let Some(c) = lock(&self.current).clone() {
            return Ok(c);
        }
        let client = self.connect_patient().await?;
        let id = 1 + self
            .connects
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let conn = Arc::new(
            Conn::new(client, id, self.writeback_bytes).map_err(|e| OpError::new(Errno::EIO, e))?,
        );
        let kind = conn.client.transport().kind().as_str();
        let sealed = match conn.client.encryption() {
            Some(suite) => format!("encrypted with {suite}"),
            None => "NOT encrypted".into(),
        };
        match conn.client.transport().device() {
            Some(dev) => {
                tracing::info!("connected to {} over {kind} ({dev}), {sealed}", self.addr())
            }
            None => tracing::info!("connected to {} over {kind}, {sealed}", self.addr()),
        }
        *lock(&self.current) = Some(conn.clone());
        Ok(conn)
    }

    /// Connects within the timeout. A server at its connection limit (the session
    /// refused `Busy`) is asked again after a pause ([`BUSY_FIRST_PAUSE`], doubling to
    /// [`BUSY_MAX_PAUSE`]) until the timeout since the first try has passed, so a busy
    /// server makes the caller wait; past the timeout the caller gets `EBUSY`. Any
    /// other failure is `ENOTCONN`.
    async fn connect_patient(&self) -> Result<Client, OpError> {
        let deadline = std::time::Instant::now() + self.timeout;
        let mut pause = BUSY_FIRST_PAUSE;
        loop {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            let creds = self.credentials.clone();
            let got = tokio::time::timeout(
                left,
                Client::connect_with(&self.host, self.port, self.choice, creds),
            )
            .await;
            match got {
                Ok(Ok(client)) => return Ok(client),
                Ok(Err(e)) if e.is_busy() && std::time::Instant::now() + pause < deadline => {
                    tracing::info!("server busy, trying again in {pause:?}: {e}");
                    tokio::time::sleep(pause).await;
                    pause = (pause * 2).min(BUSY_MAX_PAUSE);
                }
                Ok(Err(e)) if e.is_busy() => return Err(OpError::new(Errno::EBUSY, e.to_string())),
                Ok(Err(e)) => return Err(OpError::new(Errno::ENOTCONN, e.to_string())),
                Err(_) => {
                    return Err(OpError::new(
                        Errno::ENOTCONN,
                        format!("connecting to {} timed out", self.addr()),
                    ))
                }
            }
        }
    }

    /// Forgets `conn` if it is the current connection and closes it; the next call
    /// reconnects.
    pub fn drop_conn(&self, conn: &Arc<Conn>, why: &str) {
        let mut cur = lock(&self.current);
        if cur.as_ref().is_some_and(|c| Arc::ptr_eq(c, conn)) {
            tracing::warn!("connection to {} lost: {why}", self.addr());
            *cur = None;
        }
        drop(cur);
        conn.client.close();
    }

    /// Runs `f` on the live connection within the timeout; a failure that means the
    /// connection is gone drops it.
    pub async fn call<T, F, Fut>(&self, what: &str, f: F) -> Result<T, OpError>
    where
        F: FnOnce(Arc<Conn>) -> Fut,
        Fut: Future<Output = Result<T, ClientError>>,
    {
        let conn = self.conn().await?;
        match tokio::time::timeout(self.timeout, f(conn.clone())).await {
            Ok(Ok(v)) => Ok(v),
            Ok(Err(e)) => {
                if is_fatal(&e) {
                    self.drop_conn(&conn, &e.to_string());
                }
                Err(OpError::new(errno_of(&e), format!("{what}: {e}")))
            }
            Err(_) => {
                self.drop_conn(&conn, "no answer within the timeout");
                Err(OpError::new(
                    Errno::EIO,
                    format!(
                        "{what}: no answer from {} within {:?}",
                        self.addr(),
                        self.timeout
                    ),
                ))
            }
        }
    }
}

/// The first pause before a request the server answered `Busy` is sent again; each
/// further one doubles, up to [`BUSY_MAX_PAUSE`].
const BUSY_FIRST_PAUSE: Duration = Duration::from_millis(5);

/// The longest pause between two tries of a request the server answered `Busy`.
const BUSY_MAX_PAUSE: Duration = Duration::from_millis(250);

impl Remote {
    /// [`Remote::call`] for a request the server may refuse as `Busy` (at a resource
    /// limit that other clients' releases free: mapped bytes, mapped files): tried
    /// again after a pause ([`BUSY_FIRST_PAUSE`], doubling to [`BUSY_MAX_PAUSE`])
    /// until the mount's timeout since the first try has passed, so load makes the
    /// caller wait, never fail with EIO. Past the timeout the caller gets `EBUSY`.
    /// Every other answer is returned as it is.
    pub async fn call_patient<T, F, Fut>(&self, what: &str, f: F) -> Result<T, OpError>
    where
        F: Fn(Arc<Conn>) -> Fut,
        Fut: Future<Output = Result<T, ClientError>>,
    {
        let deadline = std::time::Instant::now() + self.timeout;
        let mut pause = BUSY_FIRST_PAUSE;
        loop {
            match self.call(what, &f).await {
                Err(e)
                    if e.errno == Errno::EBUSY && std::time::Instant::now() + pause < deadline =>
                {
                    tracing::info!("server busy, trying again in {pause:?}: {}", e.message);
                    tokio::time::sleep(pause).await;
                    pause = (pause * 2).min(BUSY_MAX_PAUSE);
                }
                other => return other,
            }
        }
    }
}

/// Locks a mutex whose data stays consistent even if a holder panicked.
pub fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}
