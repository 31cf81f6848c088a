//! The registration table: what the peer may touch, checked on every access.
//!
//! Invariants: an rkey names at most one live registration; a removed rkey is never
//! handed out again while the table lives (rkeys advance by an odd step modulo 2^32, so
//! they repeat only after 2^32 registrations); an access is granted only if it lies
//! wholly inside the region and the region's [`Access`] permits it.

use std::collections::HashMap;
use std::sync::Mutex;

use crate::transport::{Access, AccessFault, Memory, Op};

/// Odd step between consecutive rkeys (the golden-ratio constant), so rkeys are not
/// small consecutive integers a careless peer could hit by accident.
const RKEY_STEP: u32 = 0x9E37_79B1;

struct Entry {
    memory: Memory,
    access: Access,
}

struct Inner {
    next: u32,
    regions: HashMap<u32, Entry>,
}

/// A connection's registrations, keyed by rkey.
pub struct Table {
    inner: Mutex<Inner>,
}

/// A granted access: the memory and the byte offset into it.
pub struct Grant {
    /// The registered memory.
    pub memory: Memory,
    /// Offset of the first accessed byte from the start of the memory.
    pub offset: usize,
}

impl Table {
    /// An empty table whose first rkey is `seed` (made non-zero).
    pub fn new(seed: u32) -> Table {
        Table {
            inner: Mutex::new(Inner {
                next: seed | 1,
                regions: HashMap::new(),
            }),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        // A panic while holding this lock leaves the map consistent (every operation
        // is a single insert/remove/lookup), so poisoning carries no information.
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Adds a registration and returns its rkey.
    pub fn insert(&self, memory: Memory, access: Access) -> u32 {
        let mut inner = self.lock();
        loop {
            let rkey = inner.next;
            inner.next = inner.next.wrapping_add(RKEY_STEP);
            if rkey != 0 && !inner.regions.contains_key(&rkey) {
                inner.regions.insert(rkey, Entry { memory, access });
                return rkey;
            }
        }
    }

    /// Revokes `rkey`. Accesses checked afterwards fail with
    /// [`AccessFault::InvalidRkey`].
    pub fn remove(&self, rkey: u32) {
        self.lock().regions.remove(&rkey);
    }

    /// Number of live registrations.
    pub fn len(&self) -> usize {
        self.lock().regions.len()
    }

    /// True if nothing is registered.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Checks a peer's `op` on `addr..addr+len` under `rkey`.
    pub fn check(&self, op: Op, rkey: u32, addr: u64, len: u32) -> Result<Grant, AccessFault> {
        let inner = self.lock();
        let entry = inner.regions.get(&rkey).ok_or(AccessFault::InvalidRkey)?;
        let allowed = match op {
            Op::Read => entry.access.remote_read(),
            Op::Write => entry.access.remote_write(),
        };
        if !allowed {
            return Err(AccessFault::Denied);
        }
        let base = entry.memory.addr();
        let size = entry.memory.len() as u64;
        let offset = addr.checked_sub(base).ok_or(AccessFault::OutOfBounds)?;
        let end = offset
            .checked_add(u64::from(len))
            .ok_or(AccessFault::OutOfBounds)?;
        if end > size {
            return Err(AccessFault::OutOfBounds);
        }
        Ok(Grant {
            memory: entry.memory.clone(),
            offset: offset as usize,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transport::Buffer;

    fn table_with(access: Access) -> (Table, u32, u64) {
        let t = Table::new(12345);
        let b = Buffer::new(4096).unwrap();
        let addr = b.addr();
        let rkey = t.insert(Memory::Buffer(b), access);
        (t, rkey, addr)
    }

    #[test]
    fn in_bounds_access_is_granted() {
        let (t, rkey, addr) = table_with(Access::RemoteWrite);
        let g = t.check(Op::Write, rkey, addr + 100, 200).unwrap();
        assert_eq!(g.offset, 100);
        assert!(t.check(Op::Read, rkey, addr, 4096).is_ok());
        assert!(t.check(Op::Read, rkey, addr + 4096, 0).is_ok());
    }

    #[test]
    fn out_of_bounds_is_refused() {
        let (t, rkey, addr) = table_with(Access::RemoteWrite);
        let oob: Result<(), _> = Err(AccessFault::OutOfBounds);
        assert_eq!(t.check(Op::Read, rkey, addr + 4000, 97).err(), oob.err());
        assert_eq!(t.check(Op::Read, rkey, addr - 1, 1).err(), oob.err());
        assert_eq!(t.check(Op::Read, rkey, addr + 4097, 0).err(), oob.err());
        assert_eq!(t.check(Op::Read, rkey, u64::MAX, u32::MAX).err(), oob.err());
        assert_eq!(t.check(Op::Read, rkey, 0, 1).err(), oob.err());
    }

    #[test]
    fn access_rights_are_enforced() {
        let (t, rkey, addr) = table_with(Access::RemoteRead);
        assert_eq!(
            t.check(Op::Write, rkey, addr, 1).err(),
            Some(AccessFault::Denied)
        );
        let (t, rkey, addr) = table_with(Access::Local);
        assert_eq!(
            t.check(Op::Read, rkey, addr, 1).err(),
            Some(AccessFault::Denied)
        );
    }

    #[test]
    fn revoked_and_unknown_rkeys_are_invalid() {
        let (t, rkey, addr) = table_with(Access::RemoteWrite);
        assert_eq!(
            t.check(Op::Read, rkey ^ 0x55, addr, 1).err(),
            Some(AccessFault::InvalidRkey)
        );
        t.remove(rkey);
        assert!(t.is_empty());
        assert_eq!(
            t.check(Op::Read, rkey, addr, 1).err(),
            Some(AccessFault::InvalidRkey)
        );
    }

    #[test]
    fn rkeys_are_distinct_and_nonzero() {
        let t = Table::new(0);
        let b = Buffer::new(1).unwrap();
        let mut seen = std::collections::HashSet::new();
        for _ in 0..1000 {
            let k = t.insert(Memory::Buffer(b.clone()), Access::RemoteRead);
            assert_ne!(k, 0);
            assert!(seen.insert(k));
        }
    }
}
