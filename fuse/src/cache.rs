//! The bounded cache of verified chunks (sans-IO: no clock, no I/O).
//!
//! Invariant: only bytes that matched their manifest SHA-256 are ever inserted, so a
//! hit is returned to readers without another check. Entries are keyed by the
//! manifest hash of the file version and the chunk index: a changed file has a new
//! manifest hash and can never be served a previous version's chunk, while identical
//! content (hard links, a reopened unchanged file) shares entries.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use ferry_common::msg::Hash256;

/// Names one verified chunk: (manifest hash of the file version, chunk index).
pub type ChunkKey = (Hash256, u64);

/// Least-recently-used chunks within a byte budget.
#[derive(Debug)]
pub struct ChunkCache {
    budget: u64,
    used: u64,
    tick: u64,
    entries: HashMap<ChunkKey, (Arc<[u8]>, u64)>,
    /// Last-use tick -> key; the first entry is the least recently used.
    order: BTreeMap<u64, ChunkKey>,
}

impl ChunkCache {
    /// An empty cache holding at most `budget` bytes of chunk data.
    pub fn new(budget: u64) -> ChunkCache {
        ChunkCache {
            budget,
            used: 0,
            tick: 0,
            entries: HashMap::new(),
            order: BTreeMap::new(),
        }
    }

    /// Bytes held.
    pub fn used(&self) -> u64 {
        self.used
    }

    /// Chunks held.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// True when nothing is held.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// True if `key` is held (does not count as a use).
    pub fn contains(&self, key: &ChunkKey) -> bool {
        self.entries.contains_key(key)
    }

    /// The chunk, marked most recently used.
    pub fn get(&mut self, key: &ChunkKey) -> Option<Arc<[u8]>> {
        self.tick += 1;
        let tick = self.tick;
        let (data, last) = self.entries.get_mut(key)?;
        self.order.remove(last);
        *last = tick;
        self.order.insert(tick, *key);
        Some(data.clone())
    }

    /// Inserts a verified chunk, evicting the least recently used ones to stay within
    /// the budget. A chunk larger than the whole budget is not kept.
    pub fn insert(&mut self, key: ChunkKey, data: Arc<[u8]>) {
        let len = data.len() as u64;
        if len > self.budget {
            return;
        }
        if let Some((old, last)) = self.entries.remove(&key) {
            self.order.remove(&last);
            self.used -= old.len() as u64;
        }
        while self.used + len > self.budget {
            let Some((_, victim)) = self.order.pop_first() else {
                break;
            };
            if let Some((old, _)) = self.entries.remove(&victim) {
                self.used -= old.len() as u64;
            }
        }
        self.tick += 1;
        self.order.insert(self.tick, key);
        self.entries.insert(key, (data, self.tick));
        self.used += len;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chunk(n: usize, fill: u8) -> Arc<[u8]> {
        vec![fill; n].into()
    }

    #[test]
    fn evicts_least_recently_used_within_budget() {
        let mut c = ChunkCache::new(300);
        let m = [7; 32];
        c.insert((m, 0), chunk(100, 0));
        c.insert((m, 1), chunk(100, 1));
        c.insert((m, 2), chunk(100, 2));
        assert_eq!(c.used(), 300);
        // Touch 0 so that 1 is the oldest.
        assert_eq!(c.get(&(m, 0)).unwrap()[0], 0);
        c.insert((m, 3), chunk(100, 3));
        assert!(c.contains(&(m, 0)) && !c.contains(&(m, 1)));
        assert!(c.contains(&(m, 2)) && c.contains(&(m, 3)));
        assert_eq!(c.used(), 300);
        // A big one pushes out as many as it needs.
        c.insert((m, 4), chunk(250, 4));
        assert_eq!(c.len(), 1);
        assert_eq!(c.used(), 250);
    }

    #[test]
    fn versions_do_not_share_entries_and_reinsert_replaces() {
        let mut c = ChunkCache::new(1000);
        c.insert(([1; 32], 0), chunk(10, 1));
        assert!(c.get(&([2; 32], 0)).is_none());
        c.insert(([1; 32], 0), chunk(20, 9));
        assert_eq!(c.used(), 20);
        assert_eq!(c.get(&([1; 32], 0)).unwrap()[0], 9);
        c.insert(([1; 32], 1), chunk(2000, 0));
        assert!(
            !c.contains(&([1; 32], 1)),
            "larger than the budget: not kept"
        );
    }

    #[test]
    fn random_workload_keeps_accounting_exact() {
        use rand::{Rng, SeedableRng};
        let mut rng = rand::rngs::StdRng::seed_from_u64(5);
        let mut c = ChunkCache::new(4096);
        for _ in 0..10_000 {
            let key = ([rng.gen_range(0..3u8); 32], rng.gen_range(0..40u64));
            if rng.gen_bool(0.5) {
                c.insert(key, chunk(rng.gen_range(1..600), 0));
            } else {
                let _ = c.get(&key);
            }
            let sum: u64 = c.entries.values().map(|(d, _)| d.len() as u64).sum();
            assert_eq!(sum, c.used());
            assert!(c.used() <= 4096);
            assert_eq!(c.order.len(), c.entries.len());
        }
    }
}
