//! The inode table and the metadata caches (sans-IO: callers pass the time).
//!
//! FUSE names files by node id, and the kernel reports a lookup's node id as `st_ino`.
//! A node stands for one server file, `(dev, ino)`: its id is the server's inode
//! number, so `st_ino` matches the server and hard links share it. Where that number
//! is taken by another server file (a share spanning two filesystems), or is 0 or 1
//! (1 is the FUSE root), the node gets a synthetic id at or above [`SYNTHETIC`]
//! instead, never reused within the mount. So does a file this mount creates before the
//! server has made it ([`Nodes::provisional_key`]): it keeps that id, tied to its
//! server file by [`Nodes::rekey`], until the kernel forgets it. Invariant: one id never
//! stands for two different `(dev, ino)` at once, so a read can never reach the wrong
//! file; a node lives while the kernel holds a lookup reference. Attributes are cached
//! per path for the attribute TTL, and names found missing for the negative TTL.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use ferry_common::msg::Attr;

/// The root's node id (FUSE's `FUSE_ROOT_ID`).
pub const ROOT: u64 = 1;

/// First synthetic node id; server inode numbers at or above it are not used as ids.
pub const SYNTHETIC: u64 = 1 << 62;

/// A server file: `(dev, ino)`.
pub type FileKey = (u64, u64);

/// Most cached attributes and negative entries kept before expired ones are pruned.
const PRUNE_AT: usize = 200_000;

#[derive(Debug)]
struct Node {
    /// The path it was last looked up by (any of its names, for hard links).
    path: String,
    lookups: u64,
    /// The server file; `None` for the root.
    key: Option<FileKey>,
    /// Other names it was looked up by (hard links), at most [`OTHER_NAMES`]: one
    /// takes over `path` when that name is removed, so the node stays reachable.
    others: Vec<String>,
}

/// Most other names a node remembers.
const OTHER_NAMES: usize = 8;

/// Node ids, attribute cache and negative cache of one mount.
#[derive(Debug)]
pub struct Nodes {
    by_path: HashMap<String, u64>,
    nodes: HashMap<u64, Node>,
    /// The synthetic id standing for each key that has one.
    synthetic: HashMap<FileKey, u64>,
    next: u64,
    attrs: HashMap<String, (Attr, Instant)>,
    missing: HashMap<String, Instant>,
}

impl Default for Nodes {
    fn default() -> Self {
        Self::new()
    }
}

impl Nodes {
    /// A table holding only the root (path "").
    pub fn new() -> Nodes {
        let mut nodes = HashMap::new();
        nodes.insert(
            ROOT,
            Node {
                path: String::new(),
                lookups: 1,
                key: None,
                others: Vec::new(),
            },
        );
        Nodes {
            by_path: HashMap::from([(String::new(), ROOT)]),
            nodes,
            synthetic: HashMap::new(),
            next: SYNTHETIC,
            attrs: HashMap::new(),
            missing: HashMap::new(),
        }
    }

    /// The mount-relative path of node `ino`.
    pub fn path(&self, ino: u64) -> Option<String> {
        self.nodes.get(&ino).map(|n| n.path.clone())
    }

    /// The node id for server file `key` found at `path`, created if needed, with one
    /// more lookup reference (a lookup reply hands one to the kernel).
    pub fn remember(&mut self, path: &str, key: FileKey) -> u64 {
        if path.is_empty() {
            return ROOT;
        }
        let (_, ino) = key;
        let id = match self.nodes.get(&ino) {
            _ if self.synthetic.contains_key(&key) => self.find_synthetic(key),
            _ if ino <= ROOT || ino >= SYNTHETIC => self.find_synthetic(key),
            Some(n) if n.key == Some(key) => ino,
            Some(_) => self.find_synthetic(key),
            None => ino,
        };
        let node = self.nodes.entry(id).or_insert_with(|| Node {
            path: path.to_string(),
            lookups: 0,
            key: Some(key),
            others: Vec::new(),
        });
        node.lookups += 1;
        if node.path != path {
            let old = std::mem::replace(&mut node.path, path.to_string());
            node.others.retain(|p| p != path);
            if self.by_path.get(&old) == Some(&id) {
                self.by_path.remove(&old);
                if node.others.len() < OTHER_NAMES {
                    node.others.push(old);
                }
            }
        }
        self.by_path.insert(path.to_string(), id);
        id
    }

    /// The synthetic id already standing for `key`, or a fresh one.
    fn find_synthetic(&mut self, key: FileKey) -> u64 {
        if let Some(&id) = self.synthetic.get(&key) {
            return id;
        }
        let id = self.next;
        self.next += 1;
        self.synthetic.insert(key, id);
        id
    }

    /// A key for a file this mount made that the server has not named yet: unique
    /// within the mount, never a server's (its `dev` is `u64::MAX`), so its node gets a
    /// synthetic id; [`Nodes::rekey`] gives the node its server file later.
    pub fn provisional_key(&mut self) -> FileKey {
        let key = (u64::MAX, self.next);
        self.next += 1;
        key
    }

    /// Node `id` stands for server file `key` from now on (it had a provisional key):
    /// later lookups of `key` find the same id, so the kernel sees one inode.
    pub fn rekey(&mut self, id: u64, key: FileKey) {
        let Some(node) = self.nodes.get_mut(&id) else {
            return;
        };
        // Only a provisional key is replaced: a node's server file never changes.
        if node.key.is_none_or(|(dev, _)| dev != u64::MAX) || self.synthetic.contains_key(&key) {
            return;
        }
        if let Some(old) = node.key.replace(key) {
            if self.synthetic.get(&old) == Some(&id) {
                self.synthetic.remove(&old);
            }
        }
        if id >= SYNTHETIC {
            self.synthetic.insert(key, id);
        }
    }

    /// The server file node `ino` stands for (`None` for the root or an unknown id).
    pub fn key(&self, ino: u64) -> Option<FileKey> {
        self.nodes.get(&ino).and_then(|n| n.key)
    }

    /// The node id `path` has now, if any (no reference taken).
    pub fn id_of(&self, path: &str) -> Option<u64> {
        self.by_path.get(path).copied()
    }

    /// The kernel dropped `n` lookup references; the node goes when none are left.
    pub fn forget(&mut self, ino: u64, n: u64) {
        if ino == ROOT {
            return;
        }
        let Some(node) = self.nodes.get_mut(&ino) else {
            return;
        };
        node.lookups = node.lookups.saturating_sub(n);
        if node.lookups == 0 {
            if let Some(node) = self.nodes.remove(&ino) {
                if self.by_path.get(&node.path) == Some(&ino) {
                    self.by_path.remove(&node.path);
                }
                if let Some(key) = node.key {
                    if self.synthetic.get(&key) == Some(&ino) {
                        self.synthetic.remove(&key);
                    }
                }
            }
        }
    }

    /// Nodes known (the root included).
    pub fn len(&self) -> usize {
        self.nodes.len()
    }

    /// Never true: the root is always there.
    pub fn is_empty(&self) -> bool {
        self.nodes.is_empty()
    }

    /// Cached attributes of `path` if fetched less than `ttl` ago.
    pub fn attr(&self, path: &str, now: Instant, ttl: Duration) -> Option<Attr> {
        let (attr, at) = self.attrs.get(path)?;
        (now.saturating_duration_since(*at) < ttl).then(|| attr.clone())
    }

    /// Records attributes of `path` fetched at `now`; the name exists.
    pub fn store_attr(&mut self, path: &str, attr: Attr, now: Instant) {
        self.missing.remove(path);
        if self.attrs.len() >= PRUNE_AT {
            self.prune(now);
        }
        self.attrs.insert(path.to_string(), (attr, now));
    }

    /// True if `path` was found missing less than `ttl` before `now`.
    pub fn is_missing(&self, path: &str, now: Instant, ttl: Duration) -> bool {
        self.missing
            .get(path)
            .is_some_and(|at| now.saturating_duration_since(*at) < ttl)
    }

    /// Records that `path` did not exist at `now`.
    pub fn store_missing(&mut self, path: &str, now: Instant) {
        self.attrs.remove(path);
        if self.missing.len() >= PRUNE_AT {
            self.prune(now);
        }
        self.missing.insert(path.to_string(), now);
    }

    /// `from` was renamed to `to` (on the server): the nodes at or below `from` take
    /// their paths below `to`; a node that had `to` loses it (it was replaced); cached
    /// attributes and negative entries at or below either path are dropped.
    pub fn renamed(&mut self, from: &str, to: &str, now: Instant) {
        let under = |p: &str, top: &str| {
            p == top
                || (p.len() > top.len() && p.starts_with(top) && p.as_bytes()[top.len()] == b'/')
        };
        self.by_path.retain(|p, _| !under(p, to));
        let mut moved = Vec::new();
        for (&id, node) in self.nodes.iter_mut() {
            if id != ROOT && under(&node.path, from) {
                let new = format!("{to}{}", &node.path[from.len()..]);
                moved.push((std::mem::replace(&mut node.path, new.clone()), new, id));
            }
        }
        for (old, new, id) in moved {
            if self.by_path.get(&old) == Some(&id) {
                self.by_path.remove(&old);
            }
            self.by_path.insert(new, id);
        }
        self.attrs.retain(|p, _| !under(p, from) && !under(p, to));
        self.missing.retain(|p, _| !under(p, to));
        self.store_missing(from, now);
    }

    /// `path` was removed (on the server): its cached attributes go and it is
    /// remembered as missing; its node keeps its id until the kernel forgets it.
    pub fn removed(&mut self, path: &str, now: Instant) {
        if let Some(id) = self.by_path.remove(path) {
            // Another name of a hard-linked file takes over.
            let node = self.nodes.get_mut(&id);
            if let Some(other) = node.and_then(|n| n.others.pop().map(|o| (n, o))) {
                let (node, other) = other;
                node.path = other.clone();
                self.by_path.entry(other).or_insert(id);
            }
        }
        self.store_missing(path, now);
    }

    /// Forgets the cached attributes of every name of inode `ino` on `dev` (its link
    /// count or ctime changed).
    pub fn changed_inode(&mut self, dev: u64, ino: u64) {
        self.attrs
            .retain(|_, (a, _)| !(a.dev == dev && a.ino == ino));
    }

    /// Forgets the cached attributes of `path` (it changed).
    pub fn changed(&mut self, path: &str) {
        self.attrs.remove(path);
        self.missing.remove(path);
    }

    /// Drops entries older than an hour (TTLs are far shorter in practice); keeps the
    /// caches bounded when a huge tree is walked.
    fn prune(&mut self, now: Instant) {
        let old = |at: &Instant| now.saturating_duration_since(*at) > Duration::from_secs(3600);
        self.attrs.retain(|_, (_, at)| !old(at));
        self.missing.retain(|_, at| !old(at));
        if self.attrs.len() >= PRUNE_AT {
            self.attrs.clear();
        }
        if self.missing.len() >= PRUNE_AT {
            self.missing.clear();
        }
    }
}

/// `parent/name` for mount-relative paths ("" is the root).
pub fn join(parent: &str, name: &str) -> String {
    if parent.is_empty() {
        name.to_string()
    } else {
        format!("{parent}/{name}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ferry_common::msg::{FileKind, Timestamp};

    fn attr(size: u64) -> Attr {
        Attr {
            kind: FileKind::File,
            size,
            mode: 0o644,
            mtime: Timestamp::default(),
            symlink_target: None,
            ino: 9,
            nlink: 1,
            atime: Timestamp::default(),
            ctime: Timestamp::default(),
            blocks: 0,
            dev: 1,
        }
    }

    #[test]
    fn ids_are_server_inodes_while_referenced() {
        let mut n = Nodes::new();
        assert_eq!(n.path(ROOT).as_deref(), Some(""));
        let a = n.remember("a", (5, 100));
        assert_eq!(a, 100, "the server's inode number");
        assert_eq!(n.remember("a", (5, 100)), a);
        let b = n.remember(&join("a", "b"), (5, 101));
        assert_eq!(n.path(b).as_deref(), Some("a/b"));
        n.forget(a, 1);
        assert_eq!(n.path(a).as_deref(), Some("a"), "one reference left");
        n.forget(a, 1);
        assert_eq!(n.path(a), None);
        n.forget(ROOT, 100);
        assert_eq!(n.path(ROOT).as_deref(), Some(""));
        assert_eq!(n.remember("", (5, 2)), ROOT);
    }

    #[test]
    fn a_file_made_here_keeps_its_id_once_the_server_names_it() {
        let mut n = Nodes::new();
        let key = n.provisional_key();
        let id = n.remember("new", key);
        assert!(id >= SYNTHETIC, "no server inode yet: a synthetic id");
        assert_eq!(n.remember("new", key), id, "its lookups find it");
        n.rekey(id, (5, 200));
        assert_eq!(n.key(id), Some((5, 200)));
        assert_eq!(
            n.remember("new", (5, 200)),
            id,
            "the same inode for the kernel"
        );
        assert_eq!(n.remember("link", (5, 200)), id, "and for a hard link");
        assert_ne!(n.provisional_key(), key, "keys are never reused");
        // Forgotten by the kernel: the server's inode number from then on.
        n.forget(id, 4);
        assert_eq!(n.path(id), None);
        assert_eq!(n.remember("new", (5, 200)), 200);
    }

    #[test]
    fn a_rename_moves_the_nodes_below_and_forgets_the_replaced_name() {
        let mut n = Nodes::new();
        let now = Instant::now();
        let d = n.remember("d", (5, 10));
        let f = n.remember("d/f", (5, 11));
        let dx = n.remember("dx", (5, 12));
        let old = n.remember("e", (5, 13));
        n.store_attr("d/f", attr(3), now);
        n.renamed("d", "e", now);
        assert_eq!(n.path(d).as_deref(), Some("e"));
        assert_eq!(n.path(f).as_deref(), Some("e/f"));
        assert_eq!(
            n.path(dx).as_deref(),
            Some("dx"),
            "a sibling sharing the prefix"
        );
        assert_eq!(n.id_of("e"), Some(d));
        assert_eq!(n.id_of("d"), None);
        assert_eq!(n.id_of("d/f"), None);
        assert_eq!(n.path(old).as_deref(), Some("e"), "kept until forgotten");
        assert!(n.attr("d/f", now, Duration::MAX).is_none());
        assert!(n.attr("e/f", now, Duration::MAX).is_none());
        assert!(n.is_missing("d", now, Duration::from_secs(1)));
        n.removed("e/f", now);
        assert_eq!(n.id_of("e/f"), None);
        assert!(n.is_missing("e/f", now, Duration::from_secs(1)));
    }

    #[test]
    fn hard_links_share_a_node_and_collisions_get_synthetic_ids() {
        let mut n = Nodes::new();
        let x = n.remember("x", (5, 7));
        assert_eq!(n.remember("y", (5, 7)), x, "a hard link");
        assert_eq!(n.path(x).as_deref(), Some("y"), "last name looked up");
        // The same inode number on another filesystem of the share.
        let other = n.remember("mnt/z", (6, 7));
        assert!(other >= SYNTHETIC);
        assert_eq!(
            n.remember("mnt/z", (6, 7)),
            other,
            "stable while referenced"
        );
        assert_eq!(n.path(x).as_deref(), Some("y"));
        // Inode numbers FUSE cannot use.
        assert!(n.remember("w", (5, 1)) >= SYNTHETIC);
        assert!(n.remember("v", (5, 0)) >= SYNTHETIC);
        // A file replaced at the same path gets the node of its new inode.
        assert_eq!(n.remember("y", (5, 8)), 8);
        assert_eq!(n.id_of("y"), Some(8));
    }

    #[test]
    fn caches_expire_with_their_ttl() {
        let mut n = Nodes::new();
        let t0 = Instant::now();
        let ttl = Duration::from_secs(1);
        n.store_attr("f", attr(5), t0);
        assert_eq!(
            n.attr("f", t0 + Duration::from_millis(999), ttl)
                .unwrap()
                .size,
            5
        );
        assert!(n.attr("f", t0 + ttl, ttl).is_none());
        assert!(
            n.attr("f", t0, Duration::ZERO).is_none(),
            "ttl 0 never hits"
        );
        n.store_missing("f", t0);
        assert!(n.attr("f", t0, ttl).is_none(), "missing replaces the attr");
        assert!(n.is_missing("f", t0, ttl));
        assert!(!n.is_missing("f", t0 + ttl, ttl));
        n.store_attr("f", attr(6), t0);
        assert!(!n.is_missing("f", t0, ttl), "found again");
    }
}
