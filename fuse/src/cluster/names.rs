//! Node ids and the entry caches of a cluster mount (sans-IO: callers pass the time).
//!
//! A cluster share has no inode numbers: a name is an etcd key. A node id stands for
//! one (mount-relative path, kind) pair and keeps it for the life of the mount, so the
//! kernel sees the same `st_ino` for a name however often it forgets and looks it up
//! again, a file replaced by a new version of itself keeps its id, and a name that
//! changes kind (a file that became a directory) gets a new one. Invariant: one id
//! never stands for two (path, kind) pairs. The table grows with the names the kernel
//! has seen; it is never pruned (unlike the entries below).
//!
//! Entries are cached per path for the attribute TTL, and names found missing for the
//! negative TTL.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use ferry_cluster::model::{Entry, EntryKind};

/// The root's node id (FUSE's `FUSE_ROOT_ID`).
pub const ROOT: u64 = 1;

/// Cached entries and missing names kept before the expired ones are pruned.
const PRUNE_AT: usize = 100_000;

/// `kind` as a map key.
fn tag(kind: EntryKind) -> u8 {
    match kind {
        EntryKind::File => 0,
        EntryKind::Dir => 1,
        EntryKind::Symlink => 2,
    }
}

/// Node ids and cached entries of one cluster mount.
#[derive(Debug)]
pub struct Names {
    ids: HashMap<(String, u8), u64>,
    paths: HashMap<u64, (String, EntryKind)>,
    next: u64,
    entries: HashMap<String, (Arc<Entry>, Instant)>,
    missing: HashMap<String, Instant>,
}

impl Default for Names {
    fn default() -> Self {
        Self::new()
    }
}

impl Names {
    /// A table holding only the root (path `""`, a directory).
    pub fn new() -> Names {
        Names {
            ids: HashMap::from([((String::new(), tag(EntryKind::Dir)), ROOT)]),
            paths: HashMap::from([(ROOT, (String::new(), EntryKind::Dir))]),
            next: ROOT + 1,
            entries: HashMap::new(),
            missing: HashMap::new(),
        }
    }

    /// The node id of `path` as a `kind`, assigned on first use.
    pub fn id(&mut self, path: &str, kind: EntryKind) -> u64 {
        if path.is_empty() {
            return ROOT;
        }
        let key = (path.to_owned(), tag(kind));
        if let Some(&id) = self.ids.get(&key) {
            return id;
        }
        let id = self.next;
        self.next += 1;
        self.paths.insert(id, (path.to_owned(), kind));
        self.ids.insert(key, id);
        id
    }

    /// The mount-relative path and kind node `ino` stands for.
    pub fn path(&self, ino: u64) -> Option<(String, EntryKind)> {
        self.paths.get(&ino).cloned()
    }

    /// The entry cached for `path`, if stored less than `ttl` ago.
    pub fn entry(&self, path: &str, now: Instant, ttl: Duration) -> Option<Arc<Entry>> {
        let (entry, at) = self.entries.get(path)?;
        (now.saturating_duration_since(*at) < ttl).then(|| entry.clone())
    }

    /// Caches `entry` for `path` (and forgets that it was missing). `ttl`: how long
    /// entries live, for pruning.
    pub fn store(&mut self, path: &str, entry: Arc<Entry>, now: Instant, ttl: Duration) {
        if self.entries.len() >= PRUNE_AT {
            self.entries
                .retain(|_, (_, at)| now.saturating_duration_since(*at) < ttl);
        }
        self.missing.remove(path);
        self.entries.insert(path.to_owned(), (entry, now));
    }

    /// True if `path` was found missing less than `ttl` ago.
    pub fn is_missing(&self, path: &str, now: Instant, ttl: Duration) -> bool {
        self.missing
            .get(path)
            .is_some_and(|at| now.saturating_duration_since(*at) < ttl)
    }

    /// Remembers that `path` does not exist (and drops its cached entry).
    pub fn store_missing(&mut self, path: &str, now: Instant, ttl: Duration) {
        if self.missing.len() >= PRUNE_AT {
            self.missing
                .retain(|_, at| now.saturating_duration_since(*at) < ttl);
        }
        self.entries.remove(path);
        self.missing.insert(path.to_owned(), now);
    }

    /// Forgets what is cached about `path` (changed through this mount): its entry
    /// and that it was missing.
    pub fn forget(&mut self, path: &str) {
        self.entries.remove(path);
        self.missing.remove(path);
    }

    /// `from` was renamed to `to` (a `kind`): its node id now stands for `to`, and
    /// the id `to` had as a `kind` (a replaced file) stands for nothing any more.
    pub fn rename(&mut self, from: &str, to: &str, kind: EntryKind) {
        self.forget(from);
        self.forget(to);
        let Some(id) = self.ids.remove(&(from.to_owned(), tag(kind))) else {
            return;
        };
        if let Some(old) = self.ids.insert((to.to_owned(), tag(kind)), id) {
            self.paths.remove(&old);
        }
        self.paths.insert(id, (to.to_owned(), kind));
    }

    /// Directory `from` was renamed to `to` with everything below it: every node id
    /// of a path at or below `from` now stands for the same path below `to`; the ids
    /// of paths at or below `to` (a replaced empty directory) stand for nothing; and
    /// nothing cached about either subtree is kept.
    pub fn rename_tree(&mut self, from: &str, to: &str) {
        let moved = |p: &str| within(p, from).map(|rest| format!("{to}{rest}"));
        self.entries
            .retain(|p, _| within(p, from).is_none() && within(p, to).is_none());
        self.missing
            .retain(|p, _| within(p, from).is_none() && within(p, to).is_none());
        let replaced: Vec<(String, u8)> = self
            .ids
            .keys()
            .filter(|(p, _)| within(p, to).is_some())
            .cloned()
            .collect();
        for key in replaced {
            if let Some(id) = self.ids.remove(&key) {
                self.paths.remove(&id);
            }
        }
        let renamed: Vec<((String, u8), u64)> = self
            .ids
            .iter()
            .filter(|((p, _), _)| within(p, from).is_some())
            .map(|(k, id)| (k.clone(), *id))
            .collect();
        for ((path, t), id) in renamed {
            self.ids.remove(&(path.clone(), t));
            let new = moved(&path).expect("filtered above");
            self.ids.insert((new.clone(), t), id);
            if let Some((p, _)) = self.paths.get_mut(&id) {
                *p = new;
            }
        }
    }
}

/// The rest of `path` after `dir` if `path` is `dir` (`""`) or below it (`/...`).
fn within<'p>(path: &'p str, dir: &str) -> Option<&'p str> {
    let rest = path.strip_prefix(dir)?;
    (rest.is_empty() || rest.starts_with('/')).then_some(rest)
}

#[cfg(test)]
mod tests {
    use super::*;
    use ferry_common::msg::Timestamp;

    fn entry(kind: EntryKind, size: u64) -> Arc<Entry> {
        Arc::new(Entry {
            kind,
            mode: 0o644,
            mtime: Timestamp::default(),
            size,
            target: None,
            layout: None,
        })
    }

    #[test]
    fn ids_are_stable_per_path_and_kind_and_never_shared() {
        let mut n = Names::new();
        assert_eq!(n.id("", EntryKind::Dir), ROOT);
        let a = n.id("a", EntryKind::File);
        let b = n.id("a/b", EntryKind::File);
        assert!(a > ROOT && b > ROOT && a != b);
        assert_eq!(n.id("a", EntryKind::File), a, "a name keeps its id");
        let a_dir = n.id("a", EntryKind::Dir);
        assert_ne!(a_dir, a, "another kind is another node");
        assert_eq!(n.path(a), Some(("a".into(), EntryKind::File)));
        assert_eq!(n.path(a_dir), Some(("a".into(), EntryKind::Dir)));
        assert_eq!(n.path(ROOT), Some((String::new(), EntryKind::Dir)));
        assert_eq!(n.path(999), None);
    }

    #[test]
    fn entries_and_missing_names_expire() {
        let mut n = Names::new();
        let t0 = Instant::now();
        let ttl = Duration::from_secs(1);
        n.store("f", entry(EntryKind::File, 3), t0, ttl);
        assert_eq!(n.entry("f", t0, ttl).unwrap().size, 3);
        assert!(n.entry("f", t0 + ttl, ttl).is_none(), "expired at the TTL");
        assert!(n.entry("f", t0, Duration::ZERO).is_none());
        n.store_missing("f", t0, ttl);
        assert!(
            n.entry("f", t0, ttl).is_none(),
            "a missing name has no entry"
        );
        assert!(n.is_missing("f", t0, ttl));
        assert!(!n.is_missing("f", t0 + ttl, ttl));
        n.store("f", entry(EntryKind::File, 4), t0, ttl);
        assert!(!n.is_missing("f", t0, ttl), "found again");
    }

    #[test]
    fn a_rename_moves_the_id_and_drops_the_replaced_one() {
        let mut n = Names::new();
        let t0 = Instant::now();
        let ttl = Duration::from_secs(1);
        let a = n.id("a", EntryKind::File);
        let b = n.id("b", EntryKind::File);
        n.store("a", entry(EntryKind::File, 1), t0, ttl);
        n.store_missing("c", t0, ttl);
        n.rename("a", "b", EntryKind::File);
        assert_eq!(n.path(a), Some(("b".into(), EntryKind::File)));
        assert_eq!(n.path(b), None, "the replaced file's id stands for nothing");
        assert_eq!(n.id("b", EntryKind::File), a);
        assert_ne!(n.id("a", EntryKind::File), a, "the old name gets a new id");
        assert!(n.entry("a", t0, ttl).is_none());
        n.forget("c");
        assert!(!n.is_missing("c", t0, ttl));
    }

    #[test]
    fn a_directory_rename_moves_every_id_below_it_and_drops_the_caches() {
        let mut n = Names::new();
        let t0 = Instant::now();
        let ttl = Duration::from_secs(1);
        let d = n.id("d", EntryKind::Dir);
        let f = n.id("d/sub/f", EntryKind::File);
        let sibling = n.id("dx/f", EntryKind::File);
        let old_target = n.id("e", EntryKind::Dir);
        n.store("d/sub/f", entry(EntryKind::File, 1), t0, ttl);
        n.store("dx/f", entry(EntryKind::File, 2), t0, ttl);
        n.store_missing("e/sub/f", t0, ttl);
        n.rename_tree("d", "e");
        assert_eq!(n.path(d), Some(("e".into(), EntryKind::Dir)));
        assert_eq!(n.path(f), Some(("e/sub/f".into(), EntryKind::File)));
        assert_eq!(n.id("e/sub/f", EntryKind::File), f);
        assert_eq!(
            n.path(old_target),
            None,
            "the replaced directory's id is gone"
        );
        assert_eq!(n.path(sibling), Some(("dx/f".into(), EntryKind::File)));
        assert!(n.entry("d/sub/f", t0, ttl).is_none());
        assert!(!n.is_missing("e/sub/f", t0, ttl), "found at the new place");
        assert!(
            n.entry("dx/f", t0, ttl).is_some(),
            "a like-named sibling stays"
        );
        assert_ne!(n.id("d/sub/f", EntryKind::File), f, "the old path is new");
    }
}
