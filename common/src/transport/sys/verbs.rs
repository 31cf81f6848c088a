//! RAII wrappers over libibverbs and librdmacm, through `rdma-sys`.
//!
//! Ownership mirrors the verbs object graph: every object holds an `Arc` to the object
//! it was made from and is destroyed in `Drop`, so a parent can never be freed under a
//! child. In addition:
//!
//! - [`Mr`] owns the [`Memory`] it registers: the mapping cannot be unmapped while the
//!   device may still touch it.
//! - [`Qp`] keeps every work request's local [`Mr`] (and the buffer guard the caller
//!   handed over) in its in-flight table until [`Qp::retire`] is called for the
//!   completion, so a region is never deregistered while a work request that uses it is
//!   outstanding. Destroying the QP stops the device for good, after which the table is
//!   dropped.
//! - [`Ring`] owns a registered array of fixed-size slots for SEND/RECV and refuses to
//!   hand out the bytes of a slot that is posted to the device.
//!
//! libibverbs documents its calls as thread-safe, and librdmacm serialises its own
//! state; the wrappers are `Send + Sync` on that basis and add locks where they keep
//! state of their own.

use std::any::Any;
use std::collections::HashMap;
use std::ffi::CStr;
use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV4, SocketAddrV6};
use std::os::fd::{AsRawFd, RawFd};
use std::ptr::{null_mut, NonNull};
use std::sync::{Arc, Mutex, MutexGuard};

use memmap2::{MmapMut, MmapOptions};
use nix::libc;
use rdma_sys::*;
use tokio::io::unix::AsyncFd;
use tokio::io::Interest;

use crate::transport::{Access, Memory, RemoteSlice, TransportError};

fn os_error(op: &'static str) -> TransportError {
    TransportError::Io {
        op,
        source: io::Error::last_os_error(),
    }
}

fn errno_error(op: &'static str, errno: i32) -> TransportError {
    TransportError::Io {
        op,
        source: io::Error::from_raw_os_error(errno),
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // Every critical section below is a handful of map or flag updates: a panic inside
    // one cannot leave the data half-changed, so poisoning is ignored.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn set_nonblocking(fd: RawFd, op: &'static str) -> Result<(), TransportError> {
    use nix::fcntl::{fcntl, FcntlArg, OFlag};
    let flags = fcntl(fd, FcntlArg::F_GETFL).map_err(|e| errno_error(op, e as i32))?;
    let flags = OFlag::from_bits_truncate(flags) | OFlag::O_NONBLOCK;
    fcntl(fd, FcntlArg::F_SETFL(flags)).map_err(|e| errno_error(op, e as i32))?;
    Ok(())
}

/// Names of the RDMA devices of this machine; empty where there is no RDMA (libibverbs
/// then returns NULL with `ENOSYS`, or an empty list).
pub fn device_names() -> Vec<String> {
    let mut n: i32 = 0;
    // SAFETY: `n` is a valid out-pointer; the call returns NULL or an array of `n`
    // device pointers that stays valid until `ibv_free_device_list`.
    let list = unsafe { ibv_get_device_list(&mut n) };
    if list.is_null() {
        return Vec::new();
    }
    let mut names = Vec::new();
    for i in 0..usize::try_from(n).unwrap_or(0) {
        // SAFETY: `i < n`, so the entry is one of the list's valid device pointers, and
        // `ibv_get_device_name` returns a NUL-terminated string owned by the device.
        let name = unsafe {
            let dev = *list.add(i);
            CStr::from_ptr(ibv_get_device_name(dev))
        };
        names.push(name.to_string_lossy().into_owned());
    }
    // SAFETY: `list` came from `ibv_get_device_list` and is freed exactly once; the
    // names were copied out above.
    unsafe { ibv_free_device_list(list) };
    names
}

/// A `sockaddr` built from a Rust address, for librdmacm calls that take one.
struct RawSockaddr(libc::sockaddr_storage);

impl RawSockaddr {
    fn new(addr: SocketAddr) -> RawSockaddr {
        // SAFETY: sockaddr_storage is plain old data; all-zero is a valid value.
        let mut storage: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
        match addr {
            SocketAddr::V4(a) => {
                let sin = libc::sockaddr_in {
                    sin_family: libc::AF_INET as libc::sa_family_t,
                    sin_port: a.port().to_be(),
                    sin_addr: libc::in_addr {
                        s_addr: u32::from_ne_bytes(a.ip().octets()),
                    },
                    sin_zero: [0; 8],
                };
                // SAFETY: sockaddr_storage is larger than and aligned for sockaddr_in.
                unsafe {
                    std::ptr::write((&mut storage as *mut libc::sockaddr_storage).cast(), sin)
                };
            }
            SocketAddr::V6(a) => {
                let sin6 = libc::sockaddr_in6 {
                    sin6_family: libc::AF_INET6 as libc::sa_family_t,
                    sin6_port: a.port().to_be(),
                    sin6_flowinfo: a.flowinfo().to_be(),
                    sin6_addr: libc::in6_addr {
                        s6_addr: a.ip().octets(),
                    },
                    sin6_scope_id: a.scope_id(),
                };
                // SAFETY: sockaddr_storage is larger than and aligned for sockaddr_in6.
                unsafe {
                    std::ptr::write((&mut storage as *mut libc::sockaddr_storage).cast(), sin6)
                };
            }
        }
        RawSockaddr(storage)
    }

    fn as_mut_ptr(&mut self) -> *mut libc::sockaddr {
        (&mut self.0 as *mut libc::sockaddr_storage).cast()
    }
}

/// Reads a `sockaddr` written by librdmacm.
///
/// # Safety
/// `sa` must point to a valid sockaddr whose family tells its real size.
unsafe fn read_sockaddr(sa: *const libc::sockaddr) -> Option<SocketAddr> {
    // SAFETY: the caller guarantees a valid sockaddr; its family selects the real type,
    // which is what each cast below reads.
    unsafe {
        match i32::from((*sa).sa_family) {
            libc::AF_INET => {
                let sin = &*(sa as *const libc::sockaddr_in);
                let ip = Ipv4Addr::from(sin.sin_addr.s_addr.to_ne_bytes());
                Some(SocketAddr::V4(SocketAddrV4::new(
                    ip,
                    u16::from_be(sin.sin_port),
                )))
            }
            libc::AF_INET6 => {
                let sin6 = &*(sa as *const libc::sockaddr_in6);
                Some(SocketAddr::V6(SocketAddrV6::new(
                    Ipv6Addr::from(sin6.sin6_addr.s6_addr),
                    u16::from_be(sin6.sin6_port),
                    u32::from_be(sin6.sin6_flowinfo),
                    sin6.sin6_scope_id,
                )))
            }
            _ => None,
        }
    }
}

/// An fd to wait on with tokio's `AsyncFd`, holding a reference to the object that owns
/// it so the fd stays open and unchanged for as long as it is watched.
pub struct Watch {
    fd: RawFd,
    _owner: Arc<dyn Any + Send + Sync>,
}

impl AsRawFd for Watch {
    fn as_raw_fd(&self) -> RawFd {
        self.fd
    }
}

fn watch(fd: RawFd, owner: Arc<dyn Any + Send + Sync>) -> Result<AsyncFd<Watch>, TransportError> {
    let w = Watch { fd, _owner: owner };
    // SAFETY: `owner` owns `fd` and keeps it open, referring to the same channel, for as
    // long as the Watch lives inside the AsyncFd; `as_raw_fd` always returns `fd`.
    unsafe { AsyncFd::register_with_interest(w, Interest::READABLE) }.map_err(|e| {
        TransportError::Io {
            op: "watch an RDMA fd",
            source: e.into_parts().1,
        }
    })
}

/// An rdma_cm event channel; its fd becomes readable when an event is queued.
pub struct EventChannel {
    raw: NonNull<rdma_event_channel>,
}

// SAFETY: an event channel is an fd plus librdmacm bookkeeping that librdmacm locks
// itself; `rdma_get_cm_event` may be called from any thread.
unsafe impl Send for EventChannel {}
// SAFETY: see `Send`; all methods take `&self` and only call thread-safe librdmacm calls.
unsafe impl Sync for EventChannel {}

impl EventChannel {
    /// Opens a channel in non-blocking mode. Fails with `ENODEV`/`ENOENT` where the
    /// kernel has no RDMA connection manager.
    pub fn new() -> Result<Arc<EventChannel>, TransportError> {
        // SAFETY: no arguments; returns NULL (errno set) or a channel we own.
        let raw = unsafe { rdma_create_event_channel() };
        let raw = NonNull::new(raw).ok_or_else(|| os_error("rdma_create_event_channel"))?;
        let channel = EventChannel { raw };
        set_nonblocking(channel.fd(), "set rdma event channel non-blocking")?;
        Ok(Arc::new(channel))
    }

    fn fd(&self) -> RawFd {
        // SAFETY: `raw` is a live channel for as long as `self` exists.
        unsafe { (*self.raw.as_ptr()).fd }
    }

    /// Registers the channel's fd with tokio (must run inside a runtime).
    pub fn watch(self: &Arc<Self>) -> Result<AsyncFd<Watch>, TransportError> {
        watch(self.fd(), self.clone())
    }

    /// Takes the next queued event, copied out and acknowledged; `None` if there is
    /// none right now.
    pub fn next_event(self: &Arc<Self>) -> Result<Option<CmEvent>, TransportError> {
        let mut ev: *mut rdma_cm_event = null_mut();
        // SAFETY: `raw` is live and non-blocking; `ev` is a valid out-pointer.
        let rc = unsafe { rdma_get_cm_event(self.raw.as_ptr(), &mut ev) };
        if rc != 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::WouldBlock {
                return Ok(None);
            }
            return Err(TransportError::Io {
                op: "rdma_get_cm_event",
                source: e,
            });
        }
        // SAFETY: on success `ev` points to an event owned by librdmacm until it is
        // acknowledged below; everything needed is copied out before that.
        let event = unsafe {
            let e = &*ev;
            let kind = e.event;
            let conn = &e.param.conn;
            let private = if !conn.private_data.is_null()
                && matches!(
                    kind,
                    rdma_cm_event_type::RDMA_CM_EVENT_CONNECT_REQUEST
                        | rdma_cm_event_type::RDMA_CM_EVENT_ESTABLISHED
                        | rdma_cm_event_type::RDMA_CM_EVENT_CONNECT_RESPONSE
                        | rdma_cm_event_type::RDMA_CM_EVENT_REJECTED
                ) {
                std::slice::from_raw_parts(
                    conn.private_data.cast::<u8>(),
                    usize::from(conn.private_data_len),
                )
                .to_vec()
            } else {
                Vec::new()
            };
            let new_id = if kind == rdma_cm_event_type::RDMA_CM_EVENT_CONNECT_REQUEST {
                NonNull::new(e.id).map(|raw| CmId {
                    raw,
                    _channel: self.clone(),
                })
            } else {
                None
            };
            CmEvent {
                kind,
                status: e.status,
                id: e.id as usize,
                new_id,
                private,
                initiator_depth: conn.initiator_depth,
                responder_resources: conn.responder_resources,
            }
        };
        // SAFETY: `ev` came from `rdma_get_cm_event` and is acknowledged exactly once.
        unsafe { rdma_ack_cm_event(ev) };
        Ok(Some(event))
    }
}

impl Drop for EventChannel {
    fn drop(&mut self) {
        // SAFETY: every id made on this channel holds an `Arc` to it, so none is left.
        unsafe { rdma_destroy_event_channel(self.raw.as_ptr()) }
    }
}

/// One rdma_cm event, copied out of librdmacm's memory.
pub struct CmEvent {
    /// `RDMA_CM_EVENT_*`.
    pub kind: rdma_cm_event_type::Type,
    /// The event's status (a negative errno or a reject reason).
    pub status: i32,
    /// Address of the cm id the event is about, to match it against [`CmId::key`].
    pub id: usize,
    /// For a connect request: the new connection's id, owned by the caller now.
    pub new_id: Option<CmId>,
    /// The peer's private data, zero-padded by the transport (connect request,
    /// established, reject).
    pub private: Vec<u8>,
    /// The peer's RDMA READ initiator depth (connect request).
    pub initiator_depth: u8,
    /// The peer's RDMA READ responder resources (connect request).
    pub responder_resources: u8,
}

impl CmEvent {
    /// The event's name, e.g. `RDMA_CM_EVENT_ESTABLISHED`.
    pub fn name(&self) -> String {
        // SAFETY: returns a static NUL-terminated string for any event value.
        unsafe { CStr::from_ptr(rdma_event_str(self.kind)) }
            .to_string_lossy()
            .into_owned()
    }
}

/// Connection parameters for [`CmId::connect`] and [`CmId::accept`].
pub struct ConnParams<'a> {
    /// Private data for the peer (at most 56 bytes on connect).
    pub private: &'a [u8],
    /// RDMA READs this side may have outstanding as initiator.
    pub initiator_depth: u8,
    /// RDMA READs of the peer this side serves at once.
    pub responder_resources: u8,
}

/// An rdma_cm identifier (a "socket" of the connection manager).
pub struct CmId {
    raw: NonNull<rdma_cm_id>,
    _channel: Arc<EventChannel>,
}

// SAFETY: librdmacm calls on an id are thread-safe; the id's fields read here are
// written by librdmacm before the corresponding event is delivered.
unsafe impl Send for CmId {}
// SAFETY: see `Send`.
unsafe impl Sync for CmId {}

impl CmId {
    /// A new reliable-connected (TCP port space) id on `channel`.
    pub fn new(channel: &Arc<EventChannel>) -> Result<CmId, TransportError> {
        let mut raw: *mut rdma_cm_id = null_mut();
        // SAFETY: the channel is live; `raw` is a valid out-pointer.
        let rc = unsafe {
            rdma_create_id(
                channel.raw.as_ptr(),
                &mut raw,
                null_mut(),
                rdma_port_space::RDMA_PS_TCP,
            )
        };
        if rc != 0 {
            return Err(os_error("rdma_create_id"));
        }
        let raw = NonNull::new(raw).ok_or_else(|| os_error("rdma_create_id"))?;
        Ok(CmId {
            raw,
            _channel: channel.clone(),
        })
    }

    /// Identifies this id in [`CmEvent::id`].
    pub fn key(&self) -> usize {
        self.raw.as_ptr() as usize
    }

    /// Binds to a local address (port 0 picks one).
    pub fn bind(&self, addr: SocketAddr) -> Result<(), TransportError> {
        let mut sa = RawSockaddr::new(addr);
        // SAFETY: the id is live and `sa` is a valid sockaddr for the call's duration.
        let rc = unsafe { rdma_bind_addr(self.raw.as_ptr(), sa.as_mut_ptr()) };
        if rc != 0 {
            return Err(os_error("rdma_bind_addr"));
        }
        Ok(())
    }

    /// Starts listening; connect requests arrive on the channel.
    pub fn listen(&self, backlog: i32) -> Result<(), TransportError> {
        // SAFETY: the id is live and bound.
        if unsafe { rdma_listen(self.raw.as_ptr(), backlog) } != 0 {
            return Err(os_error("rdma_listen"));
        }
        Ok(())
    }

    /// Starts resolving `dst` to a device and GID (`ADDR_RESOLVED` follows).
    pub fn resolve_addr(&self, dst: SocketAddr, timeout_ms: i32) -> Result<(), TransportError> {
        let mut sa = RawSockaddr::new(dst);
        // SAFETY: the id is live; `sa` is valid for the call (librdmacm copies it).
        let rc = unsafe {
            rdma_resolve_addr(self.raw.as_ptr(), null_mut(), sa.as_mut_ptr(), timeout_ms)
        };
        if rc != 0 {
            return Err(os_error("rdma_resolve_addr"));
        }
        Ok(())
    }

    /// Starts resolving the route (`ROUTE_RESOLVED` follows).
    pub fn resolve_route(&self, timeout_ms: i32) -> Result<(), TransportError> {
        // SAFETY: the id is live and its address is resolved.
        if unsafe { rdma_resolve_route(self.raw.as_ptr(), timeout_ms) } != 0 {
            return Err(os_error("rdma_resolve_route"));
        }
        Ok(())
    }

    /// Moves the id (and its future events) to another channel.
    pub fn migrate(&mut self, channel: &Arc<EventChannel>) -> Result<(), TransportError> {
        // SAFETY: both the id and the channel are live; no event of the id is
        // outstanding (events are acknowledged as soon as they are read).
        if unsafe { rdma_migrate_id(self.raw.as_ptr(), channel.raw.as_ptr()) } != 0 {
            return Err(os_error("rdma_migrate_id"));
        }
        self._channel = channel.clone();
        Ok(())
    }

    fn conn_param(p: &ConnParams<'_>) -> rdma_conn_param {
        rdma_conn_param {
            private_data: p.private.as_ptr().cast(),
            private_data_len: u8::try_from(p.private.len()).unwrap_or(u8::MAX),
            responder_resources: p.responder_resources,
            initiator_depth: p.initiator_depth,
            flow_control: 1,
            // Transport retries for lost packets; a dead peer shows up as
            // IBV_WC_RETRY_EXC_ERR after them.
            retry_count: 7,
            // No receive-not-ready retries: credit-based flow control guarantees a
            // posted receive for every SEND, so an RNR NAK is a bug to surface.
            rnr_retry_count: 0,
            srq: 0,
            qp_num: 0,
        }
    }

    /// Connects (the QP must exist); `ESTABLISHED` or `REJECTED` follows.
    pub fn connect(&self, p: &ConnParams<'_>) -> Result<(), TransportError> {
        let mut param = CmId::conn_param(p);
        // SAFETY: the id is live with a QP; `param` and the private data it points to
        // live across the call (librdmacm copies them).
        if unsafe { rdma_connect(self.raw.as_ptr(), &mut param) } != 0 {
            return Err(os_error("rdma_connect"));
        }
        Ok(())
    }

    /// Accepts a connect request (the QP must exist); `ESTABLISHED` follows.
    pub fn accept(&self, p: &ConnParams<'_>) -> Result<(), TransportError> {
        let mut param = CmId::conn_param(p);
        // SAFETY: as in `connect`.
        if unsafe { rdma_accept(self.raw.as_ptr(), &mut param) } != 0 {
            return Err(os_error("rdma_accept"));
        }
        Ok(())
    }

    /// Rejects a connect request with `private` data for the peer.
    pub fn reject(&self, private: &[u8]) -> Result<(), TransportError> {
        let len = u8::try_from(private.len()).unwrap_or(u8::MAX);
        // SAFETY: the id is a live connect request; `private` is valid for the call.
        if unsafe { rdma_reject(self.raw.as_ptr(), private.as_ptr().cast(), len) } != 0 {
            return Err(os_error("rdma_reject"));
        }
        Ok(())
    }

    /// Starts an orderly disconnect: the QP moves to the error state, outstanding work
    /// requests complete as flushed, and the peer gets `DISCONNECTED`.
    pub fn disconnect(&self) {
        // SAFETY: the id is live. Failure (e.g. never connected) leaves nothing to do.
        unsafe { rdma_disconnect(self.raw.as_ptr()) };
    }

    /// The bound local port.
    pub fn local_port(&self) -> u16 {
        // SAFETY: the id is live; the call reads its bound address.
        u16::from_be(unsafe { rdma_get_src_port(self.raw.as_ptr()) })
    }

    /// The peer's address, once resolved or connected.
    pub fn peer_addr(&self) -> Option<SocketAddr> {
        // SAFETY: the id is live; its route address is a sockaddr_storage that
        // librdmacm keeps valid, and read_sockaddr reads it according to its family.
        unsafe {
            let sa = rdma_get_peer_addr(&*self.raw.as_ptr());
            read_sockaddr(sa).filter(|a| a.ip() != IpAddr::V4(Ipv4Addr::UNSPECIFIED))
        }
    }

    /// The RDMA device the id is bound to (after address resolution or a request).
    pub fn device_name(&self) -> Option<String> {
        // SAFETY: the id is live; `verbs` is NULL or a context owned by librdmacm for
        // as long as the id is bound, whose device name is a NUL-terminated string.
        unsafe {
            let verbs = (*self.raw.as_ptr()).verbs;
            if verbs.is_null() {
                return None;
            }
            let name = CStr::from_ptr(ibv_get_device_name((*verbs).device));
            Some(name.to_string_lossy().into_owned())
        }
    }

    fn verbs(&self) -> Result<*mut ibv_context, TransportError> {
        // SAFETY: the id is live; reading a field.
        let verbs = unsafe { (*self.raw.as_ptr()).verbs };
        if verbs.is_null() {
            return Err(TransportError::Local(
                "rdma_cm id is not bound to a device yet",
            ));
        }
        Ok(verbs)
    }
}

impl Drop for CmId {
    fn drop(&mut self) {
        // SAFETY: the id is live and its QP (if any) was destroyed by `Qp::drop`, which
        // holds an `Arc` to the id; events are acknowledged as soon as they are read,
        // so the call does not block.
        unsafe { rdma_destroy_id(self.raw.as_ptr()) };
    }
}

/// A protection domain on the device of a cm id.
pub struct Pd {
    raw: NonNull<ibv_pd>,
    _id: Arc<CmId>,
}

// SAFETY: a PD is an immutable handle; verbs calls using it are thread-safe.
unsafe impl Send for Pd {}
// SAFETY: see `Send`.
unsafe impl Sync for Pd {}

impl Pd {
    /// Allocates a PD on `id`'s device.
    pub fn new(id: &Arc<CmId>) -> Result<Arc<Pd>, TransportError> {
        let verbs = id.verbs()?;
        // SAFETY: `verbs` is the live context of the id, kept alive by `self.id`.
        let raw = unsafe { ibv_alloc_pd(verbs) };
        let raw = NonNull::new(raw).ok_or_else(|| os_error("ibv_alloc_pd"))?;
        Ok(Arc::new(Pd {
            raw,
            _id: id.clone(),
        }))
    }
}

impl Drop for Pd {
    fn drop(&mut self) {
        // SAFETY: every MR and QP of this PD holds an `Arc` to it, so none is left.
        unsafe { ibv_dealloc_pd(self.raw.as_ptr()) };
    }
}

/// The `ibv_access_flags` for registering `memory` with `access`.
fn access_flags(memory_writable: bool, access: Access) -> u32 {
    let mut flags = 0;
    // A read-only file mapping must not ask for LOCAL_WRITE: that would request a
    // writable pin, which a read-only mapping refuses.
    if memory_writable {
        flags |= ibv_access_flags::IBV_ACCESS_LOCAL_WRITE.0;
    }
    if access.remote_read() {
        flags |= ibv_access_flags::IBV_ACCESS_REMOTE_READ.0;
    }
    if access.remote_write() {
        flags |= ibv_access_flags::IBV_ACCESS_REMOTE_WRITE.0;
    }
    flags
}

/// A memory region: registered memory with its keys.
pub struct Mr {
    raw: NonNull<ibv_mr>,
    _pd: Arc<Pd>,
    /// Kept mapped until after deregistration (fields drop after `Drop::drop`).
    _memory: Option<Memory>,
}

// SAFETY: an MR is an immutable handle once registered.
unsafe impl Send for Mr {}
// SAFETY: see `Send`.
unsafe impl Sync for Mr {}

impl Mr {
    /// Registers `memory` for `access`. A writable remote access of a file window is
    /// refused before the device is asked (see [`crate::transport::mem`]).
    pub fn register(
        pd: &Arc<Pd>,
        memory: Memory,
        access: Access,
    ) -> Result<Arc<Mr>, TransportError> {
        if access.remote_write() && !memory.is_writable() {
            return Err(TransportError::Local(
                "a file window cannot be registered for remote write",
            ));
        }
        let flags = access_flags(memory.is_writable(), access);
        // A zero-length buffer still maps one page; register that page.
        let len = memory.len().max(1);
        // SAFETY: `memory` maps at least `len` bytes at `addr` and is kept alive in the
        // returned value until after `ibv_dereg_mr`; the flags match the mapping's
        // protection (LOCAL_WRITE only for writable buffers).
        let raw = unsafe {
            ibv_reg_mr(
                pd.raw.as_ptr(),
                memory.addr() as *mut libc::c_void,
                len,
                flags as i32,
            )
        };
        let raw = NonNull::new(raw).ok_or_else(|| os_error("ibv_reg_mr"))?;
        Ok(Arc::new(Mr {
            raw,
            _pd: pd.clone(),
            _memory: Some(memory),
        }))
    }

    /// The key the peer uses in its work requests.
    pub fn rkey(&self) -> u32 {
        // SAFETY: the MR is live; reading a field set at registration.
        unsafe { (*self.raw.as_ptr()).rkey }
    }

    /// The key local work requests use.
    pub fn lkey(&self) -> u32 {
        // SAFETY: as in `rkey`.
        unsafe { (*self.raw.as_ptr()).lkey }
    }

    /// First registered address.
    pub fn addr(&self) -> u64 {
        // SAFETY: as in `rkey`.
        unsafe { (*self.raw.as_ptr()).addr as u64 }
    }

    /// Registered length.
    pub fn len(&self) -> usize {
        // SAFETY: as in `rkey`.
        unsafe { (*self.raw.as_ptr()).length }
    }

    /// True for an empty registration (never: at least one byte is registered).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl Drop for Mr {
    fn drop(&mut self) {
        // SAFETY: the MR is live. No work request uses it: `Qp` holds an `Arc<Mr>` per
        // outstanding work request until its completion is retired or the QP is gone.
        unsafe { ibv_dereg_mr(self.raw.as_ptr()) };
    }
}

/// A registered array of equal slots for SEND and RECV work requests.
///
/// Invariant: the bytes of a slot are only touched by [`Ring::fill`] and
/// [`Ring::complete`] while the slot is not posted; posting marks it, completing
/// unmarks it.
pub struct Ring {
    // Field order matters: the MR is deregistered before the mapping is unmapped.
    mr: Mr,
    map: MmapMut,
    slot_bytes: usize,
    posted: Vec<bool>,
}

impl Ring {
    /// `slots` slots of `slot_bytes` each, registered for local access.
    pub fn new(pd: &Arc<Pd>, slots: usize, slot_bytes: usize) -> Result<Ring, TransportError> {
        let len = slots * slot_bytes;
        let mut map = MmapOptions::new()
            .len(len.max(1))
            .map_anon()
            .map_err(|source| TransportError::Io {
                op: "map a control ring",
                source,
            })?;
        let flags = ibv_access_flags::IBV_ACCESS_LOCAL_WRITE.0;
        // SAFETY: `map` is a private writable mapping of `len` bytes that the returned
        // Ring keeps alive until after the MR (declared first) is deregistered.
        let raw = unsafe {
            ibv_reg_mr(
                pd.raw.as_ptr(),
                map.as_mut_ptr().cast(),
                len.max(1),
                flags as i32,
            )
        };
        let raw = NonNull::new(raw).ok_or_else(|| os_error("ibv_reg_mr (control ring)"))?;
        Ok(Ring {
            mr: Mr {
                raw,
                _pd: pd.clone(),
                _memory: None,
            },
            map,
            slot_bytes,
            posted: vec![false; slots],
        })
    }

    /// Bytes per slot.
    pub fn slot_bytes(&self) -> usize {
        self.slot_bytes
    }

    /// Number of slots.
    pub fn slots(&self) -> usize {
        self.posted.len()
    }

    /// Writes `parts` back to back into an unposted `slot`; returns the length.
    pub fn fill(&mut self, slot: usize, parts: &[&[u8]]) -> Result<usize, TransportError> {
        if self.posted[slot] {
            return Err(TransportError::Local("control slot is still posted"));
        }
        let total: usize = parts.iter().map(|p| p.len()).sum();
        if total > self.slot_bytes {
            return Err(TransportError::Local("control frame larger than a slot"));
        }
        let mut at = slot * self.slot_bytes;
        for p in parts {
            self.map[at..at + p.len()].copy_from_slice(p);
            at += p.len();
        }
        Ok(total)
    }

    /// Marks `slot` as no longer posted (its work request completed) and returns its
    /// first `len` bytes.
    pub fn complete(&mut self, slot: usize, len: usize) -> &[u8] {
        self.posted[slot] = false;
        let start = slot * self.slot_bytes;
        &self.map[start..start + len.min(self.slot_bytes)]
    }

    fn sge(&self, slot: usize, len: usize) -> ibv_sge {
        ibv_sge {
            addr: self.map.as_ptr() as u64 + (slot * self.slot_bytes) as u64,
            length: len as u32,
            lkey: self.mr.lkey(),
        }
    }
}

/// A work completion, copied out of the CQ.
#[derive(Debug, Clone, Copy)]
pub struct Completion {
    /// The work request's id.
    pub wr_id: u64,
    /// `IBV_WC_*` status.
    pub status: ibv_wc_status::Type,
    /// Bytes received (RECV completions).
    pub byte_len: u32,
}

impl Completion {
    /// True if the work request succeeded.
    pub fn ok(&self) -> bool {
        self.status == ibv_wc_status::IBV_WC_SUCCESS
    }

    /// True if the work request was flushed because the QP went to the error state.
    pub fn flushed(&self) -> bool {
        self.status == ibv_wc_status::IBV_WC_WR_FLUSH_ERR
    }

    /// True if the peer refused a one-sided access (bad rkey, bounds or permission).
    pub fn remote_access_error(&self) -> bool {
        self.status == ibv_wc_status::IBV_WC_REM_ACCESS_ERR
    }

    /// True if the peer stopped answering (transport or RNR retries exhausted).
    pub fn peer_gone(&self) -> bool {
        matches!(
            self.status,
            ibv_wc_status::IBV_WC_RETRY_EXC_ERR | ibv_wc_status::IBV_WC_RNR_RETRY_EXC_ERR
        )
    }

    /// libibverbs' text for the status.
    pub fn status_str(&self) -> String {
        // SAFETY: returns a static NUL-terminated string for any status value.
        unsafe { CStr::from_ptr(ibv_wc_status_str(self.status)) }
            .to_string_lossy()
            .into_owned()
    }
}

/// A completion queue with its own completion channel.
pub struct Cq {
    cq: NonNull<ibv_cq>,
    channel: NonNull<ibv_comp_channel>,
    _id: Arc<CmId>,
}

// SAFETY: polling, arming and reading events are thread-safe verbs calls; the driver
// polls from one task at a time anyway.
unsafe impl Send for Cq {}
// SAFETY: see `Send`.
unsafe impl Sync for Cq {}

impl Cq {
    /// A CQ of at least `entries` entries on `id`'s device, armed for the next
    /// completion, with a non-blocking completion channel.
    pub fn new(id: &Arc<CmId>, entries: i32) -> Result<Arc<Cq>, TransportError> {
        let verbs = id.verbs()?;
        // SAFETY: `verbs` is the id's live context.
        let channel = unsafe { ibv_create_comp_channel(verbs) };
        let channel = NonNull::new(channel).ok_or_else(|| os_error("ibv_create_comp_channel"))?;
        // SAFETY: `channel` was just created on the same context.
        let cq = unsafe { ibv_create_cq(verbs, entries, null_mut(), channel.as_ptr(), 0) };
        let Some(cq) = NonNull::new(cq) else {
            let err = os_error("ibv_create_cq");
            // SAFETY: the channel has no CQ attached and is destroyed exactly once.
            unsafe { ibv_destroy_comp_channel(channel.as_ptr()) };
            return Err(err);
        };
        let cq = Cq {
            cq,
            channel,
            _id: id.clone(),
        };
        set_nonblocking(cq.fd(), "set CQ channel non-blocking")?;
        cq.arm()?;
        Ok(Arc::new(cq))
    }

    fn fd(&self) -> RawFd {
        // SAFETY: the channel is live; reading a field.
        unsafe { (*self.channel.as_ptr()).fd }
    }

    /// Registers the completion channel's fd with tokio (must run inside a runtime).
    pub fn watch(self: &Arc<Self>) -> Result<AsyncFd<Watch>, TransportError> {
        watch(self.fd(), self.clone())
    }

    fn arm(&self) -> Result<(), TransportError> {
        // SAFETY: the CQ is live.
        let rc = unsafe { ibv_req_notify_cq(self.cq.as_ptr(), 0) };
        if rc != 0 {
            return Err(errno_error("ibv_req_notify_cq", rc));
        }
        Ok(())
    }

    /// Consumes and acknowledges the channel's pending notifications, then re-arms the
    /// CQ. Poll the CQ empty afterwards: completions that arrived before re-arming do not
    /// notify again.
    pub fn take_notifications(&self) -> Result<u32, TransportError> {
        let mut n = 0u32;
        loop {
            let mut cq: *mut ibv_cq = null_mut();
            let mut ctx: *mut libc::c_void = null_mut();
            // SAFETY: the channel is live and non-blocking; out-pointers are valid.
            let rc = unsafe { ibv_get_cq_event(self.channel.as_ptr(), &mut cq, &mut ctx) };
            if rc != 0 {
                let e = io::Error::last_os_error();
                if e.kind() == io::ErrorKind::WouldBlock {
                    break;
                }
                return Err(TransportError::Io {
                    op: "ibv_get_cq_event",
                    source: e,
                });
            }
            n += 1;
        }
        if n > 0 {
            // SAFETY: the CQ is live and exactly `n` events were taken from it.
            unsafe { ibv_ack_cq_events(self.cq.as_ptr(), n) };
        }
        self.arm()?;
        Ok(n)
    }

    /// Appends up to `max` completions to `out`; returns how many.
    pub fn poll(&self, out: &mut Vec<Completion>, max: usize) -> Result<usize, TransportError> {
        const BATCH: usize = 32;
        let mut total = 0;
        while total < max {
            // SAFETY: ibv_wc is plain old data; all-zero is valid and the provider
            // overwrites the entries it returns.
            let mut wcs: [ibv_wc; BATCH] = unsafe { std::mem::zeroed() };
            // SAFETY: the CQ is live and `wcs` has room for BATCH entries.
            let n = unsafe { ibv_poll_cq(self.cq.as_ptr(), BATCH as i32, wcs.as_mut_ptr()) };
            if n < 0 {
                return Err(errno_error("ibv_poll_cq", -n));
            }
            for wc in &wcs[..n as usize] {
                out.push(Completion {
                    wr_id: wc.wr_id,
                    status: wc.status,
                    byte_len: wc.byte_len,
                });
            }
            total += n as usize;
            if (n as usize) < BATCH {
                break;
            }
        }
        Ok(total)
    }
}

impl Drop for Cq {
    fn drop(&mut self) {
        // SAFETY: the QP using this CQ holds an `Arc` to it, so it is gone; all channel
        // events were acknowledged in `take_notifications`. Destroyed exactly once, CQ
        // before its channel.
        unsafe {
            ibv_destroy_cq(self.cq.as_ptr());
            ibv_destroy_comp_channel(self.channel.as_ptr());
        }
    }
}

/// Sizes of a QP's queues.
#[derive(Debug, Clone, Copy)]
pub struct QpCaps {
    /// Send queue depth (SENDs plus RDMA READ/WRITE).
    pub send_wr: u32,
    /// Receive queue depth.
    pub recv_wr: u32,
}

/// What an outstanding work request keeps alive.
struct InFlight {
    _mr: Arc<Mr>,
    _guard: Option<Box<dyn Any + Send + Sync>>,
}

/// A reliable-connected queue pair, made on a cm id.
pub struct Qp {
    id: Arc<CmId>,
    raw: NonNull<ibv_qp>,
    inflight: Mutex<HashMap<u64, InFlight>>,
    _pd: Arc<Pd>,
    _cq: Arc<Cq>,
}

// SAFETY: posting to a QP is thread-safe in libibverbs; our own state is locked.
unsafe impl Send for Qp {}
// SAFETY: see `Send`.
unsafe impl Sync for Qp {}

/// The two one-sided operations.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RdmaOp {
    /// RDMA READ of the peer's memory into a local region.
    Read,
    /// RDMA WRITE of a local region into the peer's memory.
    Write,
}

impl Qp {
    /// Creates the id's RC QP with `cq` for both queues.
    pub fn new(
        id: &Arc<CmId>,
        pd: &Arc<Pd>,
        cq: &Arc<Cq>,
        caps: QpCaps,
    ) -> Result<Qp, TransportError> {
        // SAFETY: plain old data; all-zero is valid and the fields that matter are set.
        let mut attr: ibv_qp_init_attr = unsafe { std::mem::zeroed() };
        attr.send_cq = cq.cq.as_ptr();
        attr.recv_cq = cq.cq.as_ptr();
        attr.qp_type = ibv_qp_type::IBV_QPT_RC;
        attr.sq_sig_all = 0;
        attr.cap.max_send_wr = caps.send_wr;
        attr.cap.max_recv_wr = caps.recv_wr;
        attr.cap.max_send_sge = 1;
        attr.cap.max_recv_sge = 1;
        // SAFETY: id, PD and CQ are live and on the same device; `attr` is valid for
        // the call.
        if unsafe { rdma_create_qp(id.raw.as_ptr(), pd.raw.as_ptr(), &mut attr) } != 0 {
            return Err(os_error("rdma_create_qp"));
        }
        // SAFETY: on success librdmacm stored the QP in the id.
        let raw = unsafe { (*id.raw.as_ptr()).qp };
        let raw = NonNull::new(raw).ok_or_else(|| os_error("rdma_create_qp"))?;
        Ok(Qp {
            id: id.clone(),
            raw,
            inflight: Mutex::new(HashMap::new()),
            _pd: pd.clone(),
            _cq: cq.clone(),
        })
    }

    /// Posts a RECV of a whole `slot` of `ring`.
    pub fn post_recv(
        &self,
        ring: &mut Ring,
        slot: usize,
        wr_id: u64,
    ) -> Result<(), TransportError> {
        if ring.posted[slot] {
            return Err(TransportError::Local("receive slot posted twice"));
        }
        let mut sge = ring.sge(slot, ring.slot_bytes);
        let mut wr = ibv_recv_wr {
            wr_id,
            next: null_mut(),
            sg_list: &mut sge,
            num_sge: 1,
        };
        let mut bad: *mut ibv_recv_wr = null_mut();
        // SAFETY: the QP is live; `wr` and `sge` are valid for the call; the slot is
        // registered and, being marked posted below, untouched by us until its
        // completion is handed to `Ring::complete`.
        let rc = unsafe { ibv_post_recv(self.raw.as_ptr(), &mut wr, &mut bad) };
        if rc != 0 {
            return Err(errno_error("ibv_post_recv", rc));
        }
        ring.posted[slot] = true;
        Ok(())
    }

    /// Posts a signalled SEND of the first `len` bytes of `slot` of `ring`.
    pub fn post_send(
        &self,
        ring: &mut Ring,
        slot: usize,
        len: usize,
        wr_id: u64,
    ) -> Result<(), TransportError> {
        if ring.posted[slot] || len > ring.slot_bytes {
            return Err(TransportError::Local("bad send slot"));
        }
        let mut sge = ring.sge(slot, len);
        // SAFETY: plain old data; all-zero is valid.
        let mut wr: ibv_send_wr = unsafe { std::mem::zeroed() };
        wr.wr_id = wr_id;
        wr.sg_list = &mut sge;
        wr.num_sge = 1;
        wr.opcode = ibv_wr_opcode::IBV_WR_SEND;
        wr.send_flags = ibv_send_flags::IBV_SEND_SIGNALED.0;
        let mut bad: *mut ibv_send_wr = null_mut();
        // SAFETY: as in `post_recv`; the slot stays marked until its completion.
        let rc = unsafe { ibv_post_send(self.raw.as_ptr(), &mut wr, &mut bad) };
        if rc != 0 {
            return Err(errno_error("ibv_post_send", rc));
        }
        ring.posted[slot] = true;
        Ok(())
    }

    /// Posts a signalled RDMA READ or WRITE between `local[offset..offset + remote.len]`
    /// and `remote`. `local` and `guard` (e.g. a buffer lock) are kept until
    /// [`Qp::retire`] is called with `wr_id` after its completion.
    pub fn post_rdma(
        &self,
        op: RdmaOp,
        wr_id: u64,
        local: &Arc<Mr>,
        offset: usize,
        remote: RemoteSlice,
        guard: Option<Box<dyn Any + Send + Sync>>,
    ) -> Result<(), TransportError> {
        let len = remote.len as usize;
        if offset.checked_add(len).is_none_or(|end| end > local.len()) {
            return Err(TransportError::Local(
                "local range outside the registration",
            ));
        }
        let mut sge = ibv_sge {
            addr: local.addr() + offset as u64,
            length: remote.len,
            lkey: local.lkey(),
        };
        // SAFETY: plain old data; all-zero is valid.
        let mut wr: ibv_send_wr = unsafe { std::mem::zeroed() };
        wr.wr_id = wr_id;
        wr.sg_list = &mut sge;
        wr.num_sge = 1;
        wr.opcode = match op {
            RdmaOp::Read => ibv_wr_opcode::IBV_WR_RDMA_READ,
            RdmaOp::Write => ibv_wr_opcode::IBV_WR_RDMA_WRITE,
        };
        wr.send_flags = ibv_send_flags::IBV_SEND_SIGNALED.0;
        wr.wr = wr_t {
            rdma: rdma_t {
                remote_addr: remote.addr,
                rkey: remote.rkey,
            },
        };
        // Keep the region before posting: the completion may be polled on another
        // thread before `ibv_post_send` even returns.
        lock(&self.inflight).insert(
            wr_id,
            InFlight {
                _mr: local.clone(),
                _guard: guard,
            },
        );
        let mut bad: *mut ibv_send_wr = null_mut();
        // SAFETY: the QP is live; `wr`/`sge` are valid for the call; the local range
        // was checked against the MR, which the in-flight table keeps registered (and
        // its memory mapped) until the completion is retired.
        let rc = unsafe { ibv_post_send(self.raw.as_ptr(), &mut wr, &mut bad) };
        if rc != 0 {
            lock(&self.inflight).remove(&wr_id);
            return Err(errno_error("ibv_post_send", rc));
        }
        Ok(())
    }

    /// Releases what the RDMA work request `wr_id` kept alive; call once its
    /// completion (successful, failed or flushed) has been polled.
    pub fn retire(&self, wr_id: u64) {
        lock(&self.inflight).remove(&wr_id);
    }

    /// Number of RDMA READ/WRITE work requests not yet retired.
    pub fn outstanding(&self) -> usize {
        lock(&self.inflight).len()
    }

    /// The cm id the QP belongs to.
    pub fn id(&self) -> &Arc<CmId> {
        &self.id
    }
}

impl Drop for Qp {
    fn drop(&mut self) {
        // SAFETY: the QP is live and destroyed exactly once. After it is destroyed the
        // device no longer touches any memory of its work requests, so the in-flight
        // table (dropped after this) may release the regions.
        unsafe { rdma_destroy_qp(self.id.raw.as_ptr()) };
    }
}
