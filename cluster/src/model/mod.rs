//! Cluster mode's data model, with no I/O: what etcd holds, under which keys, and
//! where a file's stripes go.
//!
//! A Ferry cluster is an etcd cluster plus storage nodes (`ferryd --cluster`). etcd
//! holds everything that must be agreed on; the nodes hold only immutable stripe
//! objects, each a plain file in the node's store share ([`STORE_SHARE`]):
//!
//! ```text
//! /ferry/nodes/<node id>        NodeInfo, under the node's lease (gone when it dies)
//! /ferry/members/<node id>      NodeInfo as last registered (stays: a dead node is listed)
//! /ferry/shares/<share>         ShareConfig: replicas, stripe size
//! /ferry/draining/<node id>     set by `ferry cluster drain`: no new stripes go there
//! /ferry/ns/<share>/<path>      Entry: a directory, a symlink, or a file and its Layout
//! ```
//!
//! A file's bytes are cut into stripes of [`ShareConfig::stripe_bytes`]; stripe `i`
//! is the object [`Layout::object_path`]`(share, i)` on every node its
//! [`Stripe::replicas`] names, and its content is named by [`Stripe::manifest`] (the
//! manifest id of the object's chunk hashes, in [`Layout::algorithm`]). Objects are
//! never modified: a new version of a file is a new [`Layout::id`], so a node that
//! comes back after missing changes can hold only objects that no layout names any
//! more, or the same bytes that it held before, and a reader checks every object it
//! reads against the manifest in the layout.
//!
//! Invariants the writers keep:
//! - an entry with a layout is put only after every stripe is durable and verified on
//!   each replica the layout names (ferryd fsyncs and verifies before it answers an
//!   upload's commit);
//! - entries change only by a compare-and-swap on their mod revision, so two writers
//!   of one name end with one whole file, never a mix.
//!
//! [`placement`] chooses the nodes; [`gc`] decides which objects no layout names;
//! [`balance`] plans the stripe moves of a drain and of a rebalance.

pub mod balance;
pub mod gc;
pub mod locks;
pub mod placement;

use serde::{Deserialize, Serialize};

use ferry_common::msg::{Hash256, HashAlgorithm, Timestamp};

/// The share every cluster node serves its stripe objects from. Clients and nodes
/// prove the cluster's secret for it.
pub const STORE_SHARE: &str = "cluster";

/// The key prefix of everything Ferry keeps in etcd.
pub const ROOT_PREFIX: &str = "/ferry/";

/// Replicas of each stripe unless the share says otherwise.
pub const DEFAULT_REPLICAS: u8 = 2;

/// Stripe size unless the share says otherwise: 64 chunks of 1 MiB.
pub const DEFAULT_STRIPE_BYTES: u64 = 64 << 20;

/// The smallest stripe a share may have (also the alignment of every stripe: a
/// multiple of every chunk size ferryd uses, so stripe boundaries are chunk and page
/// boundaries).
pub const STRIPE_ALIGN: u64 = 1 << 20;

/// Seconds a node's registration outlives its last keep-alive unless told otherwise.
pub const DEFAULT_LEASE_TTL_SECS: i64 = 10;

/// The etcd key of node `id`'s registration.
pub fn node_key(id: &str) -> String {
    format!("{ROOT_PREFIX}nodes/{id}")
}

/// The prefix of every node registration.
pub fn nodes_prefix() -> String {
    format!("{ROOT_PREFIX}nodes/")
}

/// The etcd key of node `id`'s membership record: its last registration, kept after
/// its lease expires so that a dead node is still listed (as down).
pub fn member_key(id: &str) -> String {
    format!("{ROOT_PREFIX}members/{id}")
}

/// The prefix of every membership record.
pub fn members_prefix() -> String {
    format!("{ROOT_PREFIX}members/")
}

/// The etcd key that marks node `id` as draining: no client places new stripes there.
pub fn draining_key(id: &str) -> String {
    format!("{ROOT_PREFIX}draining/{id}")
}

/// The prefix of every draining mark.
pub fn draining_prefix() -> String {
    format!("{ROOT_PREFIX}draining/")
}

/// The etcd key of share `name`'s configuration.
pub fn share_key(name: &str) -> String {
    format!("{ROOT_PREFIX}shares/{name}")
}

/// The prefix of every share configuration.
pub fn shares_prefix() -> String {
    format!("{ROOT_PREFIX}shares/")
}

/// The prefix of every entry of every share.
pub fn ns_prefix() -> String {
    format!("{ROOT_PREFIX}ns/")
}

/// The etcd key of the entry at `path` (normalised: components joined by `/`, no
/// leading `/`, not empty) in `share`.
pub fn entry_key(share: &str, path: &str) -> String {
    format!("{ROOT_PREFIX}ns/{share}/{path}")
}

/// The prefix of every entry below directory `dir` of `share` (`""`: the root).
pub fn children_prefix(share: &str, dir: &str) -> String {
    if dir.is_empty() {
        format!("{ROOT_PREFIX}ns/{share}/")
    } else {
        format!("{ROOT_PREFIX}ns/{share}/{dir}/")
    }
}

/// Splits an entry key into its share and path; `None` for keys outside the namespace.
pub fn parse_entry_key(key: &str) -> Option<(&str, &str)> {
    let rest = key.strip_prefix(ROOT_PREFIX)?.strip_prefix("ns/")?;
    let (share, path) = rest.split_once('/')?;
    (!share.is_empty() && !path.is_empty()).then_some((share, path))
}

/// Checks a share name: what may stand between two `/` of a key and of a URL.
pub fn valid_share_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 64
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_' || b == b'.')
        && !name.starts_with('.')
}

/// Checks a stripe size: a positive multiple of [`STRIPE_ALIGN`].
pub fn valid_stripe_bytes(stripe_bytes: u64) -> bool {
    stripe_bytes != 0 && stripe_bytes % STRIPE_ALIGN == 0
}

/// Checks a node id (`ferryd --node-id`, and the ids etcd lists): the same rules as a
/// share name, so an id read from etcd is never a path.
pub fn valid_node_id(id: &str) -> bool {
    valid_share_name(id)
}

/// Checks a layout id: exactly [`LAYOUT_ID_HEX`] lowercase hex digits, as
/// [`Layout::new_id`] and the copy drivers make them. An object path is built from it,
/// so an id read from etcd that is anything else is refused before it names a path.
pub fn valid_layout_id(id: &str) -> bool {
    id.len() == LAYOUT_ID_HEX && id.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
}

/// Hex digits of a layout id (16 bytes).
pub const LAYOUT_ID_HEX: usize = 32;

/// Checks a namespace path as etcd may hold it: a valid share path
/// ([`ferry_common::path::components`]: no `..`, not absolute, no NUL, bounded), not the
/// root, and in its one spelling (no empty or `.` components), so that a client that
/// joins it onto a local directory stays below that directory.
pub fn valid_entry_path(path: &str) -> bool {
    ferry_common::path::components(path).is_ok_and(|c| !c.is_empty() && c.join("/") == path)
}

/// A store object's path taken apart: `SHARE/FAN/ID.INDEX` ([`object_path`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ObjectPath<'p> {
    /// The cluster share whose file the object is a stripe of.
    pub share: &'p str,
    /// The layout id.
    pub id: &'p str,
    /// The stripe's index.
    pub index: usize,
}

impl<'p> ObjectPath<'p> {
    /// Parses `path` if, and only if, it is exactly what [`object_path`] makes of a valid
    /// share name, a valid layout id and an index: three components, no `..`, no
    /// absolute path, no other spelling. A node takes only such paths from a peer that
    /// asks it to fetch an object (`Replicate`).
    pub fn parse(path: &'p str) -> Option<ObjectPath<'p>> {
        let mut parts = path.split('/');
        let (share, fan, name) = (parts.next()?, parts.next()?, parts.next()?);
        if parts.next().is_some() || !valid_share_name(share) {
            return None;
        }
        let (id, index) = name.split_once('.')?;
        let digits_ok = !index.is_empty() && index.len() <= 10;
        if !valid_layout_id(id) || fan != &id[..2] || !digits_ok {
            return None;
        }
        if !index.bytes().all(|b| b.is_ascii_digit()) || (index.len() > 1 && index.starts_with('0'))
        {
            return None;
        }
        let index = index.parse().ok()?;
        Some(ObjectPath { share, id, index })
    }

    /// The directories above the object, parents first (`SHARE`, `SHARE/FAN`).
    pub fn dirs(&self) -> [String; 2] {
        [
            self.share.to_owned(),
            format!("{}/{}", self.share, &self.id[..2]),
        ]
    }
}

/// A storage node's registration, refreshed while it lives.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeInfo {
    /// The node's id (`ferryd --node-id`), unique in the cluster.
    pub id: String,
    /// Where clients and other nodes reach its ferryd: `HOST:PORT`.
    pub addr: String,
    /// The transports it serves (`tcp`, `rdma`).
    pub transports: Vec<String>,
    /// Size of the file system holding its store, in bytes.
    pub capacity: u64,
    /// Bytes free there for new stripes.
    pub free: u64,
    /// When this ferryd registered, seconds since the epoch.
    pub started: i64,
    /// Bytes the node keeps free (`ferryd --min-free`): with no more free than this it
    /// is full and gets no new stripes. 0 from a node of an older release.
    #[serde(default)]
    pub reserve: u64,
}

impl NodeInfo {
    /// Bytes new stripes may still take: free space above the reserve.
    pub fn room(&self) -> u64 {
        self.free.saturating_sub(self.reserve)
    }

    /// True if the node has no room left above its reserve.
    pub fn is_full(&self) -> bool {
        self.room() == 0
    }
}

/// A cluster share's settings.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShareConfig {
    /// Copies of each stripe, on distinct nodes.
    pub replicas: u8,
    /// Bytes per stripe: a multiple of [`STRIPE_ALIGN`].
    pub stripe_bytes: u64,
}

impl Default for ShareConfig {
    fn default() -> ShareConfig {
        ShareConfig {
            replicas: DEFAULT_REPLICAS,
            stripe_bytes: DEFAULT_STRIPE_BYTES,
        }
    }
}

impl ShareConfig {
    /// Checks the settings a share may be created with.
    pub fn validate(&self) -> Result<(), String> {
        if self.replicas == 0 || self.replicas > 8 {
            return Err(format!("replicas must be 1 to 8, not {}", self.replicas));
        }
        if !valid_stripe_bytes(self.stripe_bytes) {
            return Err(format!(
                "the stripe size must be a positive multiple of {} MiB",
                STRIPE_ALIGN >> 20
            ));
        }
        Ok(())
    }
}

/// What a namespace entry is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum EntryKind {
    /// A regular file, with a [`Layout`].
    File,
    /// A directory: its children are the entries below its key.
    Dir,
    /// A symbolic link, with its target.
    Symlink,
}

/// One name in a cluster share.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Entry {
    /// What it is.
    pub kind: EntryKind,
    /// Permission bits.
    pub mode: u32,
    /// Modification time.
    pub mtime: Timestamp,
    /// Size in bytes (files).
    #[serde(default)]
    pub size: u64,
    /// A symlink's target.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub target: Option<String>,
    /// A file's stripes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub layout: Option<Layout>,
}

impl Entry {
    /// Checks an entry read from etcd before a path is built from it: a file's layout
    /// (if any) passes [`Layout::validate`] for its size; a directory or symlink has
    /// none.
    pub fn validate(&self) -> Result<(), String> {
        match (&self.kind, &self.layout) {
            (EntryKind::File, Some(l)) => l.validate(self.size),
            (EntryKind::File, None) => Ok(()),
            (_, Some(_)) => Err("a directory or symlink with a layout".into()),
            (_, None) => Ok(()),
        }
    }
}

/// Where a file's bytes are.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Layout {
    /// This version's id: 32 hex digits, fresh for every write.
    pub id: String,
    /// The chunk-hash algorithm of the stripes' manifests.
    pub algorithm: HashAlgorithm,
    /// Bytes per stripe (the last may be shorter).
    pub stripe_bytes: u64,
    /// The stripes in file order; none for an empty file.
    pub stripes: Vec<Stripe>,
}

/// One stripe of a file.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Stripe {
    /// The nodes holding a verified copy, the preferred reader first.
    pub replicas: Vec<String>,
    /// The manifest id of the object's chunks, hex.
    pub manifest: String,
    /// The layout whose object holds this stripe when it is not this layout's own: an
    /// older version of the file whose stripe of the same index had exactly these
    /// bytes (copy-on-write per stripe). `None`: this layout's own object. A layout
    /// written before this field existed has none, and reads as before.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub object: Option<String>,
}

impl Layout {
    /// Checks a layout read from etcd before any path is built from it: a valid id
    /// ([`valid_layout_id`]), a stripe size that is a positive multiple of
    /// [`STRIPE_ALIGN`], the stripes a file of `size` bytes has, each with a manifest
    /// of 64 hex digits and replicas that are valid node ids.
    pub fn validate(&self, size: u64) -> Result<(), String> {
        if !valid_layout_id(&self.id) {
            return Err(format!(
                "layout id {:?} is not {LAYOUT_ID_HEX} hex digits",
                self.id
            ));
        }
        if !valid_stripe_bytes(self.stripe_bytes) {
            return Err(format!(
                "stripe size {} is not a multiple of 1 MiB",
                self.stripe_bytes
            ));
        }
        if self.stripes.len() != stripe_count(size, self.stripe_bytes) {
            return Err(format!(
                "{} stripes for {size} bytes in stripes of {}",
                self.stripes.len(),
                self.stripe_bytes
            ));
        }
        for (i, s) in self.stripes.iter().enumerate() {
            if self.manifest(i).is_none() {
                return Err(format!("stripe {i}: manifest is not 64 hex digits"));
            }
            if let Some(bad) = s.replicas.iter().find(|n| !valid_node_id(n)) {
                return Err(format!("stripe {i}: {bad:?} is not a node id"));
            }
            if let Some(bad) = s.object.as_ref().filter(|o| !valid_layout_id(o)) {
                return Err(format!(
                    "stripe {i}: object of layout {bad:?} is not a layout id"
                ));
            }
        }
        Ok(())
    }

    /// A fresh layout id.
    pub fn new_id() -> String {
        ferry_common::seal::to_hex(&rand::random::<[u8; 16]>())
    }

    /// The path, in the store share, of stripe `index` of this version of a file of
    /// `share`: the object of the layout that holds it ([`Layout::owner`]). Spread over
    /// 256 directories by that id's first byte.
    pub fn object_path(&self, share: &str, index: usize) -> String {
        object_path(share, self.owner(index), index)
    }

    /// The id of the layout whose object holds stripe `index`: this one's, unless the
    /// stripe reuses an older version's ([`Stripe::object`]).
    pub fn owner(&self, index: usize) -> &str {
        self.stripes
            .get(index)
            .and_then(|s| s.object.as_deref())
            .unwrap_or(&self.id)
    }

    /// True if stripe `index` is held by this layout's own object (made for it, not
    /// reused from an older version).
    pub fn is_own(&self, index: usize) -> bool {
        self.owner(index) == self.id
    }

    /// Stripe `index` of this layout as a stripe of the newer version `new_id` that
    /// reuses its object: the same replicas and manifest, naming the object's owner.
    pub fn reused_by(&self, index: usize, new_id: &str) -> Option<Stripe> {
        let s = self.stripes.get(index)?;
        let owner = self.owner(index);
        Some(Stripe {
            replicas: s.replicas.clone(),
            manifest: s.manifest.clone(),
            object: (owner != new_id).then(|| owner.to_owned()),
        })
    }

    /// True if some stripe of this layout is held by `object` (a path in the store
    /// share, of a file of `share`). Constant time: the path names its stripe index,
    /// so only that stripe's owner is compared (called once per stripe of a replaced
    /// version, which may have thousands).
    pub fn names(&self, share: &str, object: &str) -> bool {
        ObjectPath::parse(object).is_some_and(|o| {
            o.share == share && o.index < self.stripes.len() && self.owner(o.index) == o.id
        })
    }

    /// True if stripe `index` of this version (a file of `size` bytes) is stripe
    /// `index` of `other` (a file of `other_size` bytes) in the same object: the same
    /// owner, manifest, algorithm, stripe size and byte range (its replicas may differ:
    /// repair and drain move them). Such a stripe of `other` may be named by a version
    /// that replaces this one without its bytes being read.
    pub fn same_stripe(&self, size: u64, other: &Layout, other_size: u64, index: usize) -> bool {
        let (Some(mine), Some(theirs)) = (self.stripes.get(index), other.stripes.get(index)) else {
            return false;
        };
        self.stripe_bytes == other.stripe_bytes
            && self.algorithm == other.algorithm
            && self.owner(index) == other.owner(index)
            && mine.manifest == theirs.manifest
            && self.stripe_range(size, index) == other.stripe_range(other_size, index)
    }

    /// Byte range of stripe `index` of a file of `size` bytes.
    pub fn stripe_range(&self, size: u64, index: usize) -> std::ops::Range<u64> {
        stripe_range(size, self.stripe_bytes, index)
    }

    /// The manifest of stripe `index` as bytes; `None` if it is not 64 hex digits.
    pub fn manifest(&self, index: usize) -> Option<Hash256> {
        ferry_common::seal::from_hex::<32>(&self.stripes.get(index)?.manifest)
    }
}

/// The store path of stripe `index` of layout `id` of a file of `share`.
pub fn object_path(share: &str, id: &str, index: usize) -> String {
    let fan = id.get(..2).unwrap_or("00");
    format!("{share}/{fan}/{id}.{index}")
}

/// Number of stripes of a file of `size` bytes.
pub fn stripe_count(size: u64, stripe_bytes: u64) -> usize {
    usize::try_from(size.div_ceil(stripe_bytes.max(1))).unwrap_or(usize::MAX)
}

/// Byte range of stripe `index` of a file of `size` bytes.
pub fn stripe_range(size: u64, stripe_bytes: u64, index: usize) -> std::ops::Range<u64> {
    let start = (index as u64).saturating_mul(stripe_bytes).min(size);
    start..start.saturating_add(stripe_bytes).min(size)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_round_trip() {
        let k = entry_key("data", "a/b.bin");
        assert_eq!(k, "/ferry/ns/data/a/b.bin");
        assert_eq!(parse_entry_key(&k), Some(("data", "a/b.bin")));
        assert_eq!(parse_entry_key("/ferry/nodes/n1"), None);
        assert!(k.starts_with(&children_prefix("data", "a")));
        assert!(k.starts_with(&children_prefix("data", "")));
        assert!(!entry_key("data2", "x").starts_with(&children_prefix("data", "")));
    }

    #[test]
    fn stripes_cover_the_file() {
        let sb = 4 << 20;
        assert_eq!(stripe_count(0, sb), 0);
        assert_eq!(stripe_count(1, sb), 1);
        assert_eq!(stripe_count(sb, sb), 1);
        assert_eq!(stripe_count(sb + 1, sb), 2);
        let size = 3 * sb + 5;
        let mut next = 0;
        for i in 0..stripe_count(size, sb) {
            let r = stripe_range(size, sb, i);
            assert_eq!(r.start, next);
            next = r.end;
        }
        assert_eq!(next, size);
    }

    #[test]
    fn share_names_and_settings() {
        assert!(valid_share_name("data-1_x.y"));
        for bad in ["", ".hidden", "a/b", "a b", &"x".repeat(65)] {
            assert!(!valid_share_name(bad), "{bad:?}");
        }
        assert!(ShareConfig::default().validate().is_ok());
        let bad_stripe = ShareConfig {
            stripe_bytes: 1000,
            ..ShareConfig::default()
        };
        assert!(bad_stripe.validate().is_err());
        let no_replicas = ShareConfig {
            replicas: 0,
            ..ShareConfig::default()
        };
        assert!(no_replicas.validate().is_err());
    }

    #[test]
    fn object_paths_parse_only_in_their_one_spelling() {
        let id = "ab12".repeat(8);
        let good = object_path("s", &id, 17);
        assert_eq!(
            ObjectPath::parse(&good),
            Some(ObjectPath {
                share: "s",
                id: &id,
                index: 17
            })
        );
        assert_eq!(
            ObjectPath::parse(&good).unwrap().dirs(),
            ["s".to_owned(), "s/ab".to_owned()]
        );
        let upper = id.to_uppercase();
        for bad in [
            "../../../../tmp/x/sub/pwn".to_owned(),
            "/tmp/y/pwn".to_owned(),
            format!("/s/ab/{id}.0"),
            format!("s/../ab/{id}.0"),
            format!("s/ab/../{id}.0"),
            format!("s//ab/{id}.0"),
            format!("s/./ab/{id}.0"),
            format!("s/ab/{id}.0/x"),
            format!("s/cd/{id}.0"),
            format!("s/AB/{upper}.0"),
            format!("s/ab/{id}"),
            format!("s/ab/{id}."),
            format!("s/ab/{id}.01"),
            format!("s/ab/{id}.-1"),
            format!("s/ab/{id}.1x"),
            format!(".s/ab/{id}.0"),
            format!("s/ab/{id}a.0"),
            format!("s/ab/{id}.0\0"),
            "s/ab".to_owned(),
            String::new(),
        ] {
            assert_eq!(ObjectPath::parse(&bad), None, "{bad:?}");
        }
    }

    #[test]
    fn entry_paths_and_layouts_from_etcd_are_checked() {
        assert!(valid_entry_path("a/b.bin"));
        for bad in [
            "",
            ".",
            "..",
            "a/../b",
            "/etc/passwd",
            "a//b",
            "a/./b",
            "a/",
            "a\0",
        ] {
            assert!(!valid_entry_path(bad), "{bad:?}");
        }
        let mut l = Layout {
            id: "0f".repeat(16),
            algorithm: HashAlgorithm::Blake3,
            stripe_bytes: 1 << 20,
            stripes: vec![Stripe {
                replicas: vec!["n1".into()],
                manifest: "00".repeat(32),
                object: None,
            }],
        };
        assert_eq!(l.validate(5), Ok(()));
        l.stripes[0].object = Some("../x".into());
        assert!(l.validate(5).is_err(), "a reused object names a layout id");
        l.stripes[0].object = Some("ab".repeat(16));
        assert_eq!(l.validate(5), Ok(()));
        l.stripes[0].object = None;
        assert!(l.validate(0).is_err(), "one stripe for an empty file");
        l.id = "../../../tmp".into();
        assert!(l.validate(5).is_err());
        l.id = "0f".repeat(16);
        l.stripes[0].replicas = vec!["../n".into()];
        assert!(l.validate(5).is_err());
        l.stripes[0].replicas = vec!["n1".into()];
        l.stripes[0].manifest = "zz".into();
        assert!(l.validate(5).is_err());
    }

    #[test]
    fn a_reused_stripe_names_its_owners_object_and_old_layouts_read_as_before() {
        let old = "ab".repeat(16);
        let new = "cd".repeat(16);
        // A layout as the previous release wrote it: no `object` field.
        let json = format!(
            r#"{{"id":"{old}","algorithm":"Blake3","stripe_bytes":1048576,"stripes":[{{"replicas":["n1"],"manifest":"{m}"}},{{"replicas":["n2"],"manifest":"{m}"}}]}}"#,
            m = "11".repeat(32)
        );
        let a: Layout = serde_json::from_str(&json).expect("an old layout parses");
        assert_eq!(a.validate((1 << 20) + 1), Ok(()));
        assert_eq!(a.object_path("s", 1), object_path("s", &old, 1));
        assert!(a.is_own(0) && a.is_own(1));
        // A newer version reuses stripe 0, and a third reuses it again: still A's.
        let mut b = a.clone();
        b.id = new.clone();
        b.stripes[0] = a.reused_by(0, &new).unwrap();
        assert_eq!(b.object_path("s", 0), object_path("s", &old, 0));
        assert_eq!(b.object_path("s", 1), object_path("s", &new, 1));
        assert!(!b.is_own(0) && b.is_own(1));
        assert!(b.names("s", &object_path("s", &old, 0)));
        assert!(!b.names("s", &object_path("s", &old, 1)));
        let c = b.reused_by(0, &"ef".repeat(16)).unwrap();
        assert_eq!(c.object.as_deref(), Some(old.as_str()));
        // Reusing one's own object names none; a layout without reuse writes no field.
        assert_eq!(b.reused_by(1, &new).unwrap().object, None);
        assert!(!serde_json::to_string(&a).unwrap().contains("object"));
        let back: Layout = serde_json::from_str(&serde_json::to_string(&b).unwrap()).unwrap();
        assert_eq!(back, b);
    }

    #[test]
    fn a_stripe_is_the_same_only_in_the_same_object_over_the_same_range() {
        const MIB: u64 = 1 << 20;
        let stripe = |n: &str, m: &str| Stripe {
            replicas: vec![n.into()],
            manifest: m.repeat(32),
            object: None,
        };
        let a = Layout {
            id: "ab".repeat(16),
            algorithm: HashAlgorithm::Blake3,
            stripe_bytes: MIB,
            stripes: vec![stripe("n1", "11"), stripe("n2", "22"), stripe("n3", "33")],
        };
        let size = 2 * MIB + 5;
        // B reuses A's stripes 0 and 2 (stripe 0 from another node now), owns stripe 1.
        let new = "cd".repeat(16);
        let mut b = a.clone();
        b.id = new.clone();
        b.stripes[0] = a.reused_by(0, &new).unwrap();
        b.stripes[0].replicas = vec!["n4".into()];
        b.stripes[1] = stripe("n1", "22");
        b.stripes[2] = a.reused_by(2, &new).unwrap();
        assert!(
            b.same_stripe(size, &a, size, 0),
            "the same object on another node"
        );
        assert!(a.same_stripe(size, &b, size, 0), "both ways");
        assert!(
            !b.same_stripe(size, &a, size, 1),
            "the same bytes in another object"
        );
        assert!(b.same_stripe(size, &a, size, 2));
        // The last stripe over another range: not the same.
        assert!(!b.same_stripe(size + 1, &a, size, 2));
        assert!(!b.same_stripe(size, &a, size, 3), "past the end");
        let mut other = b.clone();
        other.algorithm = HashAlgorithm::Sha256;
        assert!(!other.same_stripe(size, &a, size, 0));
        let mut other = b.clone();
        other.stripes[0].manifest = "44".repeat(32);
        assert!(!other.same_stripe(size, &a, size, 0));
    }

    #[test]
    fn object_paths_fan_out_by_id() {
        let l = Layout {
            id: "ab12".repeat(8),
            algorithm: HashAlgorithm::Blake3,
            stripe_bytes: 1 << 20,
            stripes: vec![],
        };
        assert_eq!(
            l.object_path("s", 3),
            format!("s/ab/{}.3", "ab12".repeat(8))
        );
    }
}
