//! Transports: one-sided READ/WRITE against registered memory, plus control messages.
//!
//! A [`Transport`] is one connection to one peer. It offers exactly what an RDMA
//! reliable-connected queue pair does, so that the protocol code is the same on every
//! backend:
//!
//! - [`Transport::register`] makes local [`Memory`] accessible and returns a
//!   [`Registration`] whose [`RegionDesc`] (`{addr, len, rkey}`) can be sent to the
//!   peer. Dropping the registration revokes the rkey.
//! - [`Transport::read`] copies bytes of a peer's region into a local registered
//!   [`Buffer`] (RDMA READ); [`Transport::write`] copies local registered bytes into a
//!   peer's region (RDMA WRITE). The peer's application code takes no part: its
//!   transport engine serves the operation against its registration table.
//! - [`Transport::send`] / [`Transport::recv`] carry small control messages, at most
//!   [`crate::codec::MAX_CTRL_FRAME_BYTES`] each, in order; at most
//!   [`MAX_QUEUED_CTRL_BYTES`] wait to be sent at once.
//!
//! Backends: `rdma::Rdma` (kernel verbs through rdma-sys, feature `rdma`, on by
//! default), [`tcp::Tcp`] (software RDMA over TCP, always available) and, with the
//! `fault-injection` feature, `faulty::Faulty`, a wrapper for tests.

use std::sync::Arc;

use async_trait::async_trait;

pub mod sealed;
pub mod sys;
pub mod tcp;

#[cfg(feature = "rdma")]
pub mod rdma;

pub use sys::mem;

#[cfg(feature = "fault-injection")]
pub mod faulty;

pub use mem::{Buffer, FileWindow, Memory};

use crate::msg::RegionDesc;

/// Most bytes of control messages one side keeps queued for its peer: beyond this,
/// [`Transport::send`] waits until the peer has taken some. A peer that stops reading
/// therefore holds up its own connection instead of growing this side's memory.
pub const MAX_QUEUED_CTRL_BYTES: usize = 4 << 20;

/// What the peer may do with a registered region.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Access {
    /// Only local operations use it (a READ's destination, a WRITE's source); the peer
    /// cannot touch it.
    Local,
    /// The peer may RDMA-READ it.
    RemoteRead,
    /// The peer may RDMA-READ and RDMA-WRITE it. Only [`Buffer`] memory qualifies.
    RemoteWrite,
}

impl Access {
    /// True if the peer may read the region.
    pub fn remote_read(self) -> bool {
        matches!(self, Access::RemoteRead | Access::RemoteWrite)
    }

    /// True if the peer may write the region.
    pub fn remote_write(self) -> bool {
        matches!(self, Access::RemoteWrite)
    }
}

/// Which backend a connection runs on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TransportKind {
    /// Software RDMA over TCP.
    Tcp,
    /// Kernel RDMA verbs (a real or Soft-RoCE device).
    Rdma,
}

impl TransportKind {
    /// Lowercase name, as in `--transport` and `--json`.
    pub fn as_str(self) -> &'static str {
        match self {
            TransportKind::Tcp => "tcp",
            TransportKind::Rdma => "rdma",
        }
    }
}

/// What `--transport` asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum TransportChoice {
    /// RDMA where a device and a peer that speaks it are there, else TCP.
    #[default]
    Auto,
    /// RDMA or fail.
    Rdma,
    /// The TCP transport only.
    Tcp,
}

impl TransportChoice {
    /// Lowercase name, as on the command line.
    pub fn as_str(self) -> &'static str {
        match self {
            TransportChoice::Auto => "auto",
            TransportChoice::Rdma => "rdma",
            TransportChoice::Tcp => "tcp",
        }
    }
}

impl std::str::FromStr for TransportChoice {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "auto" => Ok(TransportChoice::Auto),
            "rdma" => Ok(TransportChoice::Rdma),
            "tcp" => Ok(TransportChoice::Tcp),
            other => Err(format!(
                "unknown transport '{other}' (expected auto, rdma or tcp)"
            )),
        }
    }
}

impl std::fmt::Display for TransportChoice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A slice `addr..addr+len` of a peer's region, addressed with its rkey.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RemoteSlice {
    /// Remote key of the peer's registration.
    pub rkey: u32,
    /// Address of the first byte, inside the peer's region.
    pub addr: u64,
    /// Length in bytes.
    pub len: u32,
}

impl RemoteSlice {
    /// The slice `offset..offset+len` of the region `desc`, checked against its bounds
    /// on this side too (the peer checks again).
    pub fn of(desc: &RegionDesc, offset: u64, len: u32) -> Option<RemoteSlice> {
        let end = offset.checked_add(u64::from(len))?;
        if end > desc.len {
            return None;
        }
        Some(RemoteSlice {
            rkey: desc.rkey,
            addr: desc.addr.checked_add(offset)?,
            len,
        })
    }
}

/// Why a one-sided access was refused by the memory owner.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AccessFault {
    /// The rkey is unknown or was revoked.
    InvalidRkey,
    /// The access reaches outside the registered region.
    OutOfBounds,
    /// The region does not grant this kind of access (e.g. WRITE to a read-only region).
    Denied,
    /// The peer's device refused the access (RDMA remote access error: the verbs do not
    /// say whether the rkey, the bounds or the permission was wrong), or the peer could
    /// not read the granted memory (on TCP: a registered file window whose file was
    /// truncated below it).
    Refused,
}

impl std::fmt::Display for AccessFault {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            AccessFault::InvalidRkey => "invalid or revoked rkey",
            AccessFault::OutOfBounds => "access outside the registered region",
            AccessFault::Denied => "access not permitted by the region",
            AccessFault::Refused => {
                "remote access error (revoked or invalid rkey, out of bounds, not permitted, or unreadable memory)"
            }
        })
    }
}

/// One-sided operation names, for errors.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    /// RDMA READ.
    Read,
    /// RDMA WRITE.
    Write,
}

impl std::fmt::Display for Op {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Op::Read => "RDMA READ",
            Op::Write => "RDMA WRITE",
        })
    }
}

/// Errors of a transport.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TransportError {
    /// The peer refused a one-sided operation; its memory is untouched.
    #[error("{op} refused by peer: {fault} (rkey {rkey:#x}, addr {addr:#x}, len {len})")]
    RemoteAccess {
        /// The operation.
        op: Op,
        /// Why it was refused.
        fault: AccessFault,
        /// The rkey used.
        rkey: u32,
        /// The address used.
        addr: u64,
        /// The length used.
        len: u32,
    },
    /// A local registration cannot be used this way (bounds, or writable access asked of
    /// read-only memory). Nothing was sent.
    #[error("local memory misuse: {0}")]
    Local(&'static str),
    /// The connection is closed.
    #[error("connection closed")]
    Closed,
    /// The peer broke the transport framing; the connection is closed.
    #[error("transport protocol violation: {0}")]
    Protocol(String),
    /// No RDMA here: no device, or no RDMA connection manager in the kernel.
    #[error("RDMA is not available: {0}")]
    Unavailable(String),
    /// The RDMA peer could not be reached or refused the connection.
    #[error("RDMA connection to {peer} failed: {reason}")]
    Connect {
        /// The address tried.
        peer: String,
        /// What happened.
        reason: String,
    },
    /// A work request failed on the device (other than a remote access error).
    #[error("{op} failed: {status}")]
    WorkRequest {
        /// The operation.
        op: &'static str,
        /// libibverbs' status text.
        status: String,
    },
    /// A socket or device error.
    #[error("{op}: {source}")]
    Io {
        /// What was being done.
        op: &'static str,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
}

/// Local memory registered with a transport.
///
/// Invariant: while it lives, `desc().rkey` grants the peer the [`Access`] it was
/// registered with over exactly `desc().addr .. desc().addr + desc().len`. Dropping it
/// revokes the rkey; an operation the engine has already started completes against
/// memory kept alive by the engine's own reference.
pub struct Registration {
    desc: RegionDesc,
    memory: Memory,
    access: Access,
    backend: Box<dyn std::any::Any + Send + Sync>,
}

impl Registration {
    /// Builds a registration; `backend` (the backend's handle, which revokes the rkey
    /// when dropped) is dropped when the registration is. Called by backends only.
    pub fn new(
        desc: RegionDesc,
        memory: Memory,
        access: Access,
        backend: Box<dyn std::any::Any + Send + Sync>,
    ) -> Registration {
        Registration {
            desc,
            memory,
            access,
            backend,
        }
    }

    /// The backend's handle, if it is a `T` (how a backend finds its own state, e.g. the
    /// memory region, behind a registration it made).
    pub fn backend<T: 'static>(&self) -> Option<&T> {
        self.backend.downcast_ref()
    }

    /// The descriptor to advertise to the peer.
    pub fn desc(&self) -> RegionDesc {
        self.desc
    }

    /// The registered memory.
    pub fn memory(&self) -> &Memory {
        &self.memory
    }

    /// The access granted to the peer.
    pub fn access(&self) -> Access {
        self.access
    }

    /// The buffer an RDMA READ of `len` bytes may land in at `offset`: the memory must
    /// be a buffer and the range inside it. Checked locally before anything is posted.
    pub fn read_destination(
        &self,
        offset: usize,
        len: u32,
    ) -> Result<&Arc<Buffer>, TransportError> {
        let buf = self
            .buffer()
            .ok_or(TransportError::Local("READ destination must be a buffer"))?;
        if offset
            .checked_add(len as usize)
            .is_none_or(|end| end > buf.len())
        {
            return Err(TransportError::Local(
                "READ destination range outside the registration",
            ));
        }
        Ok(buf)
    }

    /// Checks that an RDMA WRITE may take `len` bytes from `offset` of this memory.
    pub fn check_write_source(&self, offset: usize, len: u32) -> Result<(), TransportError> {
        if offset
            .checked_add(len as usize)
            .is_none_or(|end| end > self.memory.len())
        {
            return Err(TransportError::Local(
                "WRITE source range outside the registration",
            ));
        }
        Ok(())
    }

    /// The buffer, if the registered memory is one.
    pub fn buffer(&self) -> Option<&Arc<Buffer>> {
        match &self.memory {
            Memory::Buffer(b) => Some(b),
            Memory::File(_) => None,
        }
    }
}

impl std::fmt::Debug for Registration {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Registration")
            .field("desc", &self.desc)
            .field("access", &self.access)
            .finish()
    }
}

/// One connection to a peer. See the module docs for the contract.
#[async_trait]
pub trait Transport: Send + Sync {
    /// Which backend this is.
    fn kind(&self) -> TransportKind;

    /// The peer's address, for logs.
    fn peer(&self) -> String;

    /// The local device carrying the connection, where there is one (e.g. `rxe0`).
    fn device(&self) -> Option<String> {
        None
    }

    /// Registers `memory` with `access`. Fails with [`TransportError::Local`] if
    /// `access` is [`Access::RemoteWrite`] and the memory is a file window.
    fn register(&self, memory: Memory, access: Access) -> Result<Registration, TransportError>;

    /// RDMA READ: copies the peer's `src` into `dst` at `dst_offset`. `dst` must hold a
    /// [`Buffer`]. Completes when the bytes are in `dst`.
    async fn read(
        &self,
        src: RemoteSlice,
        dst: &Registration,
        dst_offset: usize,
    ) -> Result<(), TransportError>;

    /// RDMA WRITE: copies `src[src_offset..src_offset + dst.len]` into the peer's `dst`.
    /// Completes when the peer's memory holds the bytes.
    async fn write(
        &self,
        src: &Registration,
        src_offset: usize,
        dst: RemoteSlice,
    ) -> Result<(), TransportError>;

    /// Sends one control message, in order with earlier ones. Waits while
    /// [`MAX_QUEUED_CTRL_BYTES`] of this side's messages are still queued for the peer
    /// (a peer that does not read holds up its own connection, not this side's
    /// memory); fails with [`TransportError::Closed`] once the connection is closed,
    /// including while waiting.
    async fn send(&self, msg: Vec<u8>) -> Result<(), TransportError>;

    /// Receives the next control message; `Ok(None)` once the peer has closed cleanly.
    /// Only one task may call this at a time.
    async fn recv(&self) -> Result<Option<Vec<u8>>, TransportError>;

    /// Closes the connection. Messages already queued are still delivered if the peer
    /// takes them; sends waiting for queue space fail with [`TransportError::Closed`]
    /// at once, outstanding operations once the queue is written (on TCP at the latest
    /// after `tcp::CLOSE_GRACE`, however slow the peer).
    fn close(&self);
}

/// A shareable transport handle.
pub type SharedTransport = Arc<dyn Transport>;
