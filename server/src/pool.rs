//! A connection's pool of registered chunk buffers.
//!
//! Invariant: at most `depth` buffers exist per connection and each is lent to one
//! chunk operation at a time, so a connection's bulk memory is bounded by
//! `depth * chunk_bytes` however many windows and transfers it runs. Buffers are
//! registered once (local access only: the peer can never touch them) and reused,
//! because fresh memory is slow to fault in. Each buffer is counted in the server's
//! registration gauge from its registration until it is dropped with the pool, which
//! happens when the connection's last request task is gone.

use std::io;
use std::sync::{Arc, Mutex};

use ferry_common::transport::{
    Access, Buffer, Memory, Registration, SharedTransport, TransportError,
};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::gauge::{Gauge, Held};

/// Why no buffer could be lent.
#[derive(Debug, thiserror::Error)]
pub enum PoolError {
    /// The pool was closed (its connection is going away).
    #[error("buffer pool closed")]
    Closed,
    /// Allocating a new buffer failed.
    #[error("cannot allocate a chunk buffer")]
    Allocate(#[source] io::Error),
    /// Registering a new buffer with the transport failed.
    #[error("cannot register a buffer")]
    Register(#[source] TransportError),
}

/// The pool.
pub struct Pool {
    transport: SharedTransport,
    chunk_bytes: usize,
    permits: Arc<Semaphore>,
    registrations: Gauge,
    free: Mutex<Vec<Pooled>>,
}

/// A registered buffer and its place in the registration gauge (dropped in this order).
struct Pooled {
    reg: Registration,
    _counted: Held,
}

/// A buffer on loan; returned to the pool on drop.
pub struct Lease {
    pool: Arc<Pool>,
    buf: Option<Pooled>,
    _permit: OwnedSemaphorePermit,
}

impl Pool {
    /// A pool of up to `depth` buffers of `chunk_bytes` for `transport`, each counted
    /// in `registrations` while it is registered.
    pub fn new(
        transport: SharedTransport,
        chunk_bytes: usize,
        depth: usize,
        registrations: Gauge,
    ) -> Arc<Pool> {
        Arc::new(Pool {
            transport,
            chunk_bytes,
            permits: Arc::new(Semaphore::new(depth)),
            registrations,
            free: Mutex::new(Vec::new()),
        })
    }

    /// Waits for a free buffer.
    pub async fn lease(self: &Arc<Self>) -> Result<Lease, PoolError> {
        let permit = self
            .permits
            .clone()
            .acquire_owned()
            .await
            .map_err(|_| PoolError::Closed)?;
        let reused = self.free.lock().unwrap_or_else(|p| p.into_inner()).pop();
        let buf = match reused {
            Some(b) => b,
            None => {
                let buf = Buffer::new(self.chunk_bytes).map_err(PoolError::Allocate)?;
                let reg = self
                    .transport
                    .register(Memory::Buffer(buf), Access::Local)
                    .map_err(PoolError::Register)?;
                Pooled {
                    reg,
                    _counted: self.registrations.hold(1),
                }
            }
        };
        Ok(Lease {
            pool: self.clone(),
            buf: Some(buf),
            _permit: permit,
        })
    }
}

impl Lease {
    /// The leased registration (a [`Buffer`] of the pool's chunk size).
    pub fn reg(&self) -> &Registration {
        &self
            .buf
            .as_ref()
            .expect("lease holds its registration until drop")
            .reg
    }

    /// The leased buffer.
    pub fn buffer(&self) -> &Arc<Buffer> {
        self.reg().buffer().expect("pool registrations are buffers")
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        if let Some(b) = self.buf.take() {
            self.pool
                .free
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .push(b);
        }
    }
}
