//! Registered copies of file windows, for kernels that cannot pin a file mapping.
//!
//! Linux < 6.2 pins every memory registration for writing (`FOLL_WRITE |
//! FOLL_FORCE`), which a shared read-only file mapping refuses with EFAULT. There, a
//! file window is copied (`pread`, never through the mapping) into anonymous memory
//! and that is registered: a snapshot of the window taken at registration, which the
//! chunk hashes still verify. Copying into a buffer whose pages already exist costs one
//! copy; a private copy-on-write mapping pinned for writing costs a page allocation,
//! a copy and a free for every page, which is what made uploads on 6.1 several times
//! slower than on 6.12 under emulation.
//!
//! Invariant: a pooled buffer is handed out only when the pool holds the only
//! reference to it (its last registration and every work request on it are gone, so
//! it is deregistered), and the pool never holds more than [`POOL_BYTES`].

use std::sync::{Arc, Mutex};

use crate::transport::sys::mem::{Buffer, FileWindow};

/// Most bytes of copy buffers a connection keeps for reuse.
pub const POOL_BYTES: usize = 64 << 20;

/// Reusable anonymous buffers, by exact length (a registration's length is the
/// window's).
#[derive(Debug, Default)]
pub struct WindowCopies {
    pool: Mutex<Vec<Arc<Buffer>>>,
}

impl WindowCopies {
    /// A buffer holding a copy of `window`'s bytes, reused from the pool when an idle
    /// one of the same length is there.
    pub fn copy_of(&self, window: &FileWindow) -> std::io::Result<Arc<Buffer>> {
        let buffer = self.take(window.len())?;
        buffer.fill_from(window)?;
        Ok(buffer)
    }

    /// Bytes held by the pool (idle or in use).
    #[cfg(test)]
    pub fn pooled_bytes(&self) -> usize {
        lock(&self.pool).iter().map(|b| b.len()).sum()
    }

    fn take(&self, len: usize) -> std::io::Result<Arc<Buffer>> {
        let mut pool = lock(&self.pool);
        // strong_count == 1: only the pool holds it; nobody can clone it meanwhile,
        // since clones are only made here under the lock.
        if let Some(b) = pool
            .iter()
            .find(|b| b.len() == len && Arc::strong_count(b) == 1)
        {
            return Ok(b.clone());
        }
        let fresh = Buffer::new(len)?;
        let held: usize = pool.iter().map(|b| b.len()).sum();
        if held + len > POOL_BYTES {
            // Make room by dropping idle buffers; if none are idle, do not pool this one.
            pool.retain(|b| Arc::strong_count(b) > 1);
        }
        if pool.iter().map(|b| b.len()).sum::<usize>() + len <= POOL_BYTES {
            pool.push(fresh.clone());
        }
        Ok(fresh)
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    // Critical sections are short list updates; poisoning cannot leave them torn.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    fn window_of(bytes: &[u8]) -> Arc<FileWindow> {
        let mut f = tempfile::tempfile().unwrap();
        f.write_all(bytes).unwrap();
        FileWindow::map(&f, 0, bytes.len()).unwrap()
    }

    #[test]
    fn copies_hold_the_window_and_idle_buffers_are_reused() {
        let copies = WindowCopies::default();
        let a = window_of(&[7u8; 8192]);
        let first = copies.copy_of(&a).unwrap();
        assert_eq!(&*first.blocking_read(), &[7u8; 8192][..]);
        let addr = first.addr();
        // In use: a second copy of the same length gets another buffer.
        let second = copies.copy_of(&window_of(&[9u8; 8192])).unwrap();
        assert_ne!(second.addr(), addr);
        drop(first);
        // Idle again: reused, and refilled with the new window's bytes.
        let third = copies.copy_of(&window_of(&[3u8; 8192])).unwrap();
        assert_eq!(third.addr(), addr);
        assert_eq!(&*third.blocking_read(), &[3u8; 8192][..]);
        // Another length never gets a buffer of the wrong size.
        let odd = copies.copy_of(&window_of(&[1u8; 100])).unwrap();
        assert_eq!(odd.len(), 100);
        assert!(copies.pooled_bytes() <= POOL_BYTES);
    }

    #[test]
    fn the_pool_stays_within_its_bytes() {
        let copies = WindowCopies::default();
        let big = POOL_BYTES / 2 + 4096;
        let w = window_of(&vec![5u8; big]);
        let held: Vec<_> = (0..3).map(|_| copies.copy_of(&w).unwrap()).collect();
        assert!(copies.pooled_bytes() <= POOL_BYTES);
        drop(held);
        let _again = copies.copy_of(&w).unwrap();
        assert!(copies.pooled_bytes() <= POOL_BYTES);
    }
}
