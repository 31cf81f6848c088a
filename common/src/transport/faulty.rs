//! A transport wrapper that injects faults, for tests (feature `fault-injection`).
//!
//! It delegates to a real transport and, on the operations its [`FaultPlan`] names,
//! corrupts data in flight or fails the operation. Corruption is done the way a bad
//! wire would do it: a READ's destination gets one bit flipped after the bytes landed;
//! a WRITE's destination gets one bit flipped by an extra one-byte WRITE, so the
//! sender's own memory stays intact.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use async_trait::async_trait;

use super::{
    Access, Buffer, Memory, Registration, RemoteSlice, SharedTransport, Transport, TransportError,
    TransportKind,
};

/// Which operations of one kind get a bit flipped.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Flip {
    /// None.
    #[default]
    Never,
    /// Only operation number `n` (counting from 0).
    Nth(u64),
    /// Every one.
    Every,
}

impl Flip {
    fn hits(self, n: u64) -> bool {
        match self {
            Flip::Never => false,
            Flip::Nth(k) => k == n,
            Flip::Every => true,
        }
    }
}

/// Which operations go wrong. Operation numbers count from 0, per kind.
#[derive(Debug, Clone, Default)]
pub struct FaultPlan {
    /// READs whose data gets one bit flipped.
    pub flip_read: Flip,
    /// WRITEs whose data gets one bit flipped.
    pub flip_write: Flip,
    /// Fail every one-sided operation from this one on (counting READs and WRITEs
    /// together), and close the connection.
    pub fail_after: Option<u64>,
    /// Faults that actually happened (bits flipped, operations failed), over every
    /// connection wrapped with this plan or a clone of it: a test reads it to prove
    /// its fault fired.
    pub fired: Arc<AtomicU64>,
}

impl FaultPlan {
    /// Faults that happened so far.
    pub fn fired(&self) -> u64 {
        self.fired.load(Ordering::SeqCst)
    }

    fn fire(&self) {
        self.fired.fetch_add(1, Ordering::SeqCst);
    }
}

/// The fault-injecting wrapper.
pub struct Faulty {
    inner: SharedTransport,
    plan: FaultPlan,
    reads: AtomicU64,
    writes: AtomicU64,
    ops: AtomicU64,
}

impl Faulty {
    /// Wraps `inner`.
    pub fn new(inner: SharedTransport, plan: FaultPlan) -> Arc<Faulty> {
        Arc::new(Faulty {
            inner,
            plan,
            reads: AtomicU64::new(0),
            writes: AtomicU64::new(0),
            ops: AtomicU64::new(0),
        })
    }

    fn count_op(&self) -> Result<(), TransportError> {
        let n = self.ops.fetch_add(1, Ordering::SeqCst);
        if self.plan.fail_after.is_some_and(|limit| n >= limit) {
            self.plan.fire();
            self.inner.close();
            return Err(TransportError::Closed);
        }
        Ok(())
    }
}

#[async_trait]
impl Transport for Faulty {
    fn kind(&self) -> TransportKind {
        self.inner.kind()
    }

    fn peer(&self) -> String {
        self.inner.peer()
    }

    fn register(&self, memory: Memory, access: Access) -> Result<Registration, TransportError> {
        self.inner.register(memory, access)
    }

    async fn read(
        &self,
        src: RemoteSlice,
        dst: &Registration,
        dst_offset: usize,
    ) -> Result<(), TransportError> {
        self.count_op()?;
        let n = self.reads.fetch_add(1, Ordering::SeqCst);
        self.inner.read(src, dst, dst_offset).await?;
        if self.plan.flip_read.hits(n) && src.len > 0 {
            if let Some(buf) = dst.buffer() {
                let at = dst_offset + src.len as usize / 2;
                buf.write().await[at] ^= 0x01;
                self.plan.fire();
            }
        }
        Ok(())
    }

    async fn write(
        &self,
        src: &Registration,
        src_offset: usize,
        dst: RemoteSlice,
    ) -> Result<(), TransportError> {
        self.count_op()?;
        let n = self.writes.fetch_add(1, Ordering::SeqCst);
        self.inner.write(src, src_offset, dst).await?;
        if self.plan.flip_write.hits(n) && dst.len > 0 {
            let k = dst.len as usize / 2;
            let original = match src.memory() {
                Memory::File(f) => {
                    let mut one = [0u8];
                    f.read_at(src_offset + k, &mut one)
                        .map_err(|source| TransportError::Io {
                            op: "read the byte to flip",
                            source,
                        })?;
                    one[0]
                }
                Memory::Buffer(b) => b.read().await[src_offset + k],
            };
            let one = Buffer::new(1).map_err(|source| TransportError::Io {
                op: "allocate fault buffer",
                source,
            })?;
            one.write().await[0] = original ^ 0x01;
            let reg = self.inner.register(Memory::Buffer(one), Access::Local)?;
            let target = RemoteSlice {
                rkey: dst.rkey,
                addr: dst.addr + k as u64,
                len: 1,
            };
            self.inner.write(&reg, 0, target).await?;
            self.plan.fire();
        }
        Ok(())
    }

    async fn send(&self, msg: Vec<u8>) -> Result<(), TransportError> {
        self.inner.send(msg).await
    }

    async fn recv(&self) -> Result<Option<Vec<u8>>, TransportError> {
        self.inner.recv().await
    }

    fn close(&self) {
        self.inner.close()
    }
}
