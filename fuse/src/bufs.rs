//! Reply buffers that are reused rather than allocated per read.
//!
//! A large `Vec` is served by fresh pages from the kernel on this kind of machine, and
//! first-touch faults (zeroing each page, charging it) cost a sequential read about as
//! much as hashing its bytes. Buffers handed back after a reply keep their pages, so a
//! steady stream of reads faults nothing.
//!
//! Invariant: at most [`BufPool::keep`] buffers are held, each at most
//! [`MAX_KEPT_CAPACITY`] bytes of capacity, so the pool never holds more than their
//! product.

use std::sync::Mutex;

/// Largest capacity a returned buffer may have and still be kept (larger ones, which
/// FUSE never asks for with its default 1 MiB reads, are freed).
pub const MAX_KEPT_CAPACITY: usize = 4 << 20;

/// A bounded free list of byte buffers.
#[derive(Debug)]
pub struct BufPool {
    free: Mutex<Vec<Vec<u8>>>,
    keep: usize,
}

impl BufPool {
    /// A pool keeping at most `keep` idle buffers.
    pub fn new(keep: usize) -> BufPool {
        BufPool {
            free: Mutex::new(Vec::new()),
            keep,
        }
    }

    /// Most idle buffers kept.
    pub fn keep(&self) -> usize {
        self.keep
    }

    /// An empty buffer with room for at least `capacity` bytes, reused when one is idle.
    pub fn take(&self, capacity: usize) -> Vec<u8> {
        let reused = self.free.lock().unwrap_or_else(|p| p.into_inner()).pop();
        match reused {
            Some(mut v) => {
                v.clear();
                v.reserve(capacity);
                v
            }
            None => Vec::with_capacity(capacity),
        }
    }

    /// Returns `buf` for reuse (dropped if the pool is full or it is too large).
    pub fn give(&self, buf: Vec<u8>) {
        if buf.capacity() > MAX_KEPT_CAPACITY {
            return;
        }
        let mut free = self.free.lock().unwrap_or_else(|p| p.into_inner());
        if free.len() < self.keep {
            free.push(buf);
        }
    }

    /// Idle buffers held now.
    pub fn idle(&self) -> usize {
        self.free.lock().unwrap_or_else(|p| p.into_inner()).len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffers_are_reused_cleared_and_bounded() {
        let pool = BufPool::new(2);
        let mut a = pool.take(100);
        a.extend_from_slice(b"abc");
        let ptr = a.as_ptr();
        pool.give(a);
        let b = pool.take(10);
        assert!(b.is_empty(), "a reused buffer comes back empty");
        assert_eq!(b.as_ptr(), ptr, "the idle buffer is reused");
        assert!(b.capacity() >= 100);
        pool.give(b);
        pool.give(Vec::with_capacity(8));
        pool.give(Vec::with_capacity(8));
        assert_eq!(pool.idle(), 2, "at most `keep` idle buffers");
        pool.give(Vec::with_capacity(MAX_KEPT_CAPACITY + 1));
        assert_eq!(pool.idle(), 2);
        let _ = pool.take(1);
        pool.give(Vec::with_capacity(MAX_KEPT_CAPACITY + 1));
        assert_eq!(pool.idle(), 1, "an oversized buffer is not kept");
    }
}
