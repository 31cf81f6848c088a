//! The server's traffic counters ([`ferry_common::msg::Counters`]) and the transport
//! wrapper that keeps them: every connection's transport is wrapped in a [`Counted`],
//! so every one-sided READ and WRITE the server issues (upload windows and batches,
//! download windows and batches, file handles) and every control frame it sends or
//! receives is counted in one place, whichever module issued it.
//!
//! Counts are of completed operations: a READ or WRITE that failed, or a frame the
//! transport did not take, is not counted.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use async_trait::async_trait;
use ferry_common::msg::Counters;
use ferry_common::transport::{
    Access, Memory, Registration, RemoteSlice, SharedTransport, Transport, TransportError,
    TransportKind,
};

/// Server-wide traffic counters, since start, over every connection.
#[derive(Debug, Default)]
pub struct Traffic {
    read_bytes: AtomicU64,
    write_bytes: AtomicU64,
    ctrl_received_bytes: AtomicU64,
    ctrl_sent_bytes: AtomicU64,
    file_written_bytes: AtomicU64,
}

impl Traffic {
    /// Counts `bytes` written to disk by a `FileWrite`.
    pub fn file_written(&self, bytes: u64) {
        self.file_written_bytes.fetch_add(bytes, Ordering::Relaxed);
    }

    /// The counters now.
    pub fn counters(&self) -> Counters {
        Counters {
            read_bytes: self.read_bytes.load(Ordering::Relaxed),
            write_bytes: self.write_bytes.load(Ordering::Relaxed),
            ctrl_received_bytes: self.ctrl_received_bytes.load(Ordering::Relaxed),
            ctrl_sent_bytes: self.ctrl_sent_bytes.load(Ordering::Relaxed),
            file_written_bytes: self.file_written_bytes.load(Ordering::Relaxed),
        }
    }
}

/// A transport whose completed operations are counted in a [`Traffic`]; everything
/// else is the inner transport's.
pub struct Counted {
    inner: SharedTransport,
    traffic: Arc<Traffic>,
}

impl Counted {
    /// `inner`, counted in `traffic`.
    pub fn wrap(inner: SharedTransport, traffic: Arc<Traffic>) -> SharedTransport {
        Arc::new(Counted { inner, traffic })
    }
}

#[async_trait]
impl Transport for Counted {
    fn kind(&self) -> TransportKind {
        self.inner.kind()
    }

    fn peer(&self) -> String {
        self.inner.peer()
    }

    fn device(&self) -> Option<String> {
        self.inner.device()
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
        self.inner.read(src, dst, dst_offset).await?;
        self.traffic
            .read_bytes
            .fetch_add(u64::from(src.len), Ordering::Relaxed);
        Ok(())
    }

    async fn write(
        &self,
        src: &Registration,
        src_offset: usize,
        dst: RemoteSlice,
    ) -> Result<(), TransportError> {
        self.inner.write(src, src_offset, dst).await?;
        self.traffic
            .write_bytes
            .fetch_add(u64::from(dst.len), Ordering::Relaxed);
        Ok(())
    }

    async fn send(&self, msg: Vec<u8>) -> Result<(), TransportError> {
        let len = msg.len() as u64;
        self.inner.send(msg).await?;
        self.traffic
            .ctrl_sent_bytes
            .fetch_add(len, Ordering::Relaxed);
        Ok(())
    }

    async fn recv(&self) -> Result<Option<Vec<u8>>, TransportError> {
        let msg = self.inner.recv().await?;
        if let Some(m) = &msg {
            self.traffic
                .ctrl_received_bytes
                .fetch_add(m.len() as u64, Ordering::Relaxed);
        }
        Ok(msg)
    }

    fn close(&self) {
        self.inner.close()
    }
}
