//! The cluster's metadata in etcd: node registrations, share settings and the
//! namespace (see [`crate::model`] for the keys and the invariants).
//!
//! Every change to a namespace entry is a transaction that compares the entry's mod
//! revision with the one the writer read (0: absent), so a writer never overwrites a
//! version it has not seen; [`Meta::commit`] reports [`Commit::Conflict`] instead.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use crate::model::{
    self, children_prefix, entry_key, node_key, nodes_prefix, parse_entry_key, share_key,
    shares_prefix, Entry, NodeInfo, ShareConfig,
};
use etcd_client::{Client as Etcd, Compare, CompareOp, GetOptions, PutOptions, Txn, TxnOp};
use ferry_common::msg::{ErrorKind, RemoteError};

use super::etcd_config::EtcdConfig;
use super::etcd_connect::{classify, connect_options, request_error};
use super::tree_rename::{Delete, Guard, TreeKey, TreePlan, TreeRead};
use ferry_client::error::ClientError;
use ferry_client::etcd_error::EtcdConfigError;
use ferry_client::etcd_error::EtcdError;

/// How long connecting to etcd may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// How long one etcd request may take (a restarted etcd answers within it, or the
/// operation fails cleanly).
const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);

/// A connection to the cluster's etcd.
#[derive(Clone)]
pub struct Meta {
    etcd: Etcd,
    endpoints: Vec<String>,
    /// What it connected with (to say who was refused).
    config: Arc<EtcdConfig>,
}

/// A process's one etcd connection ([`Meta`]), made on first use and made again, from
/// the configuration's files, after a user of it saw etcd fail ([`EtcdLink::reset`]):
/// so rotated certificates and passwords are picked up, and every user in the process
/// (a node's registration, its `Replicate` fetches) shares the connection.
///
/// Invariant: at most one connection is being made at a time, and all users get the
/// same [`Meta`] until it is reset.
#[derive(Debug)]
pub struct EtcdLink {
    config: EtcdConfig,
    current: tokio::sync::Mutex<Option<Meta>>,
}

impl EtcdLink {
    /// A link to the etcd `config` describes, not yet connected.
    pub fn new(config: EtcdConfig) -> Arc<EtcdLink> {
        Arc::new(EtcdLink {
            config,
            current: tokio::sync::Mutex::new(None),
        })
    }

    /// The connection, made now if there is none.
    pub async fn get(&self) -> Result<Meta, ClientError> {
        let mut current = self.current.lock().await;
        if let Some(meta) = current.as_ref() {
            return Ok(meta.clone());
        }
        let meta = Meta::connect(&self.config).await?;
        *current = Some(meta.clone());
        Ok(meta)
    }

    /// Drops the connection: the next [`EtcdLink::get`] connects again.
    pub async fn reset(&self) {
        *self.current.lock().await = None;
    }
}

impl std::fmt::Debug for Meta {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Meta")
            .field("endpoints", &self.endpoints)
            .finish()
    }
}

/// The outcome of a compare-and-swap on an entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Commit {
    /// Written; the new mod revision.
    Done(i64),
    /// The entry changed since it was read (or the parent directory is gone).
    Conflict,
}

/// An entry with the revision it was read at.
#[derive(Debug, Clone)]
pub struct Versioned {
    /// The entry.
    pub entry: Entry,
    /// Its etcd mod revision (what a compare-and-swap compares).
    pub revision: i64,
}

fn not_found(what: String) -> ClientError {
    ClientError::Remote(RemoteError {
        kind: ErrorKind::NotFound,
        message: what,
    })
}

impl Meta {
    /// Connects to etcd as `config` says (TLS, user) and asks it once, so that an
    /// unreachable or refusing etcd fails here, with an [`EtcdError`] that says why.
    pub async fn connect(config: &EtcdConfig) -> Result<Meta, ClientError> {
        let urls = config.urls();
        let shown = urls.join(",");
        if urls.is_empty() {
            return Err(EtcdError::Config(EtcdConfigError::Invalid(
                "no etcd endpoint given".into(),
            ))
            .into());
        }
        let opts = connect_options(config, CONNECT_TIMEOUT, REQUEST_TIMEOUT)?;
        // With a user, connecting authenticates (and so reaches etcd) already.
        let mut etcd = Etcd::connect(&urls, Some(opts))
            .await
            .map_err(|e| classify(config, &shown, &e))?;
        // The connection is lazy: ask once, so an unreachable etcd fails here.
        etcd.get(
            model::ROOT_PREFIX,
            Some(GetOptions::new().with_count_only()),
        )
        .await
        .map_err(|e| classify(config, &shown, &e))?;
        Ok(Meta {
            etcd,
            endpoints: urls,
            config: Arc::new(config.clone()),
        })
    }

    /// The endpoints, as URLs.
    pub fn endpoints(&self) -> &[String] {
        &self.endpoints
    }

    /// The error of request `op` that failed with `e`.
    pub(crate) fn err(&self, op: &str, e: etcd_client::Error) -> ClientError {
        request_error(&self.config, &self.endpoints.join(","), op, &e).into()
    }

    /// The raw etcd client, for the node's lease keeper.
    pub(crate) fn etcd(&self) -> Etcd {
        self.etcd.clone()
    }

    /// Every registered (so alive: its lease is current) node, by id.
    pub async fn nodes(&self) -> Result<Vec<NodeInfo>, ClientError> {
        self.node_list(nodes_prefix(), "reading the nodes").await
    }

    /// The node records under `prefix`, by id.
    async fn node_list(&self, prefix: String, op: &str) -> Result<Vec<NodeInfo>, ClientError> {
        let resp = self
            .etcd
            .clone()
            .get(prefix, Some(GetOptions::new().with_prefix()))
            .await
            .map_err(|e| self.err(op, e))?;
        let mut out: Vec<NodeInfo> = resp
            .kvs()
            .iter()
            .filter_map(|kv| serde_json::from_slice::<NodeInfo>(kv.value()).ok())
            .filter(|n| {
                // Node ids name sessions, logs and layouts' replicas: never a path.
                let ok = model::valid_node_id(&n.id);
                if !ok {
                    tracing::warn!(id = n.id, "ignoring a node record whose id is not valid");
                }
                ok
            })
            .collect();
        out.sort_by(|a: &NodeInfo, b| a.id.cmp(&b.id));
        Ok(out)
    }

    /// Puts node `info` under `lease`, and its membership record (no lease).
    pub async fn put_node(&self, info: &NodeInfo, lease: i64) -> Result<(), ClientError> {
        let value = serde_json::to_vec(info).expect("node info serialises");
        let txn = Txn::new().and_then(vec![
            TxnOp::put(
                node_key(&info.id),
                value.clone(),
                Some(PutOptions::new().with_lease(lease)),
            ),
            TxnOp::put(model::member_key(&info.id), value, None),
        ]);
        self.etcd
            .clone()
            .txn(txn)
            .await
            .map_err(|e| self.err("registering the node", e))?;
        Ok(())
    }

    /// Every node that ever registered (its last registration), by id.
    pub async fn members(&self) -> Result<Vec<NodeInfo>, ClientError> {
        self.node_list(model::members_prefix(), "reading the members")
            .await
    }

    /// Share `name`'s settings; a clear error if it was never created.
    pub async fn share(&self, name: &str) -> Result<ShareConfig, ClientError> {
        let resp = self
            .etcd
            .clone()
            .get(share_key(name), None)
            .await
            .map_err(|e| self.err("reading the share", e))?;
        let kv = resp.kvs().first().ok_or_else(|| {
            ClientError::Remote(RemoteError {
                kind: ErrorKind::NoSuchShare,
                message: format!(
                    "no cluster share '{name}' (create it with: ferry cluster add-share {name})"
                ),
            })
        })?;
        serde_json::from_slice(kv.value())
            .map_err(|e| ClientError::Cluster(format!("share '{name}': bad settings in etcd: {e}")))
    }

    /// Every share and its settings.
    pub async fn shares(&self) -> Result<Vec<(String, ShareConfig)>, ClientError> {
        let prefix = shares_prefix();
        let resp = self
            .etcd
            .clone()
            .get(prefix.clone(), Some(GetOptions::new().with_prefix()))
            .await
            .map_err(|e| self.err("reading the shares", e))?;
        Ok(resp
            .kvs()
            .iter()
            .filter_map(|kv| {
                let name = kv.key_str().ok()?.strip_prefix(&prefix)?.to_owned();
                Some((name, serde_json::from_slice(kv.value()).ok()?))
            })
            .collect())
    }

    /// Creates share `name` (or changes its settings); existing files keep their
    /// layouts.
    pub async fn put_share(&self, name: &str, config: &ShareConfig) -> Result<(), ClientError> {
        let value = serde_json::to_vec(config).expect("share config serialises");
        self.etcd
            .clone()
            .put(share_key(name), value, None)
            .await
            .map_err(|e| self.err("writing the share", e))?;
        Ok(())
    }

    /// The entry at `path` of `share` (`""`: the root, a directory), or `None`.
    pub async fn entry(&self, share: &str, path: &str) -> Result<Option<Versioned>, ClientError> {
        if path.is_empty() {
            return Ok(Some(Versioned {
                entry: root_entry(),
                revision: 0,
            }));
        }
        // Visible only if every ancestor exists (an unpublished snapshot's entries
        // are not): one transaction reads the entry if they all do.
        let when: Vec<Compare> = ancestors(path)
            .map(|a| Compare::version(entry_key(share, a), CompareOp::Greater, 0))
            .collect();
        let txn = Txn::new()
            .when(when)
            .and_then(vec![TxnOp::get(entry_key(share, path), None)]);
        let resp = self
            .etcd
            .clone()
            .txn(txn)
            .await
            .map_err(|e| self.err("reading an entry", e))?;
        if !resp.succeeded() {
            return Ok(None);
        }
        for op in resp.op_responses() {
            if let etcd_client::TxnOpResponse::Get(g) = op {
                if let Some(kv) = g.kvs().first() {
                    return Ok(Some(Versioned {
                        entry: decode(kv.value(), path)?,
                        revision: kv.mod_revision(),
                    }));
                }
            }
        }
        Ok(None)
    }

    /// The entry at `path`, or a not-found error naming it.
    pub async fn existing(&self, share: &str, path: &str) -> Result<Versioned, ClientError> {
        self.entry(share, path)
            .await?
            .ok_or_else(|| not_found(format!("{share}/{path}: no such file or directory")))
    }

    /// Every visible entry below directory `dir` of `share` (all depths), by path:
    /// those whose every ancestor below `dir` exists too (see [`Meta::entry`]).
    pub async fn below(
        &self,
        share: &str,
        dir: &str,
    ) -> Result<Vec<(String, Versioned)>, ClientError> {
        let all = self.range(children_prefix(share, dir)).await?;
        let dirs: std::collections::HashSet<&str> = all
            .iter()
            .filter(|(_, v)| v.entry.kind == model::EntryKind::Dir)
            .map(|(p, _)| p.as_str())
            .collect();
        let visible: Vec<bool> = all
            .iter()
            .map(|(p, _)| {
                ancestors(p)
                    .filter(|a| a.len() > dir.len())
                    .all(|a| dirs.contains(a))
            })
            .collect();
        Ok(all
            .into_iter()
            .zip(visible)
            .filter_map(|(e, v)| v.then_some(e))
            .collect())
    }

    /// Every entry below `dir` of `share`, visible or not (an unpublished snapshot's).
    pub async fn below_all(
        &self,
        share: &str,
        dir: &str,
    ) -> Result<Vec<(String, Versioned)>, ClientError> {
        self.range(children_prefix(share, dir)).await
    }

    /// Removes every entry below `dir` of `share` (not `dir` itself), in one request.
    pub async fn remove_below(&self, share: &str, dir: &str) -> Result<(), ClientError> {
        self.etcd
            .clone()
            .delete(
                children_prefix(share, dir),
                Some(etcd_client::DeleteOptions::new().with_prefix()),
            )
            .await
            .map_err(|e| self.err("removing a subtree", e))?;
        Ok(())
    }

    /// The ids of the nodes marked draining ([`model::draining_key`]).
    pub async fn draining(&self) -> Result<BTreeSet<String>, ClientError> {
        let prefix = model::draining_prefix();
        let resp = self
            .etcd
            .clone()
            .get(
                prefix.as_str(),
                Some(GetOptions::new().with_prefix().with_keys_only()),
            )
            .await
            .map_err(|e| self.err("reading the draining nodes", e))?;
        Ok(resp
            .kvs()
            .iter()
            .filter_map(|kv| kv.key_str().ok()?.strip_prefix(&prefix).map(str::to_owned))
            .filter(|id| model::valid_node_id(id))
            .collect())
    }

    /// Marks node `id` draining (`on`: no client places new stripes there), or clears
    /// the mark.
    pub async fn set_draining(&self, id: &str, on: bool) -> Result<(), ClientError> {
        let key = model::draining_key(id);
        let mut etcd = self.etcd.clone();
        let r = if on {
            etcd.put(key, "", None).await.map(drop)
        } else {
            etcd.delete(key, None).await.map(drop)
        };
        r.map_err(|e| self.err("marking a node draining", e))
    }

    /// Records that layout `id` is named by more than one entry (a backup's link), so
    /// replacing one of them does not remove its objects.
    pub async fn mark_shared(&self, id: &str) -> Result<(), ClientError> {
        self.etcd
            .clone()
            .put(format!("{}shared/{id}", model::ROOT_PREFIX), "", None)
            .await
            .map_err(|e| self.err("marking a shared layout", e))?;
        Ok(())
    }

    /// Whether layout `id` was ever marked shared.
    pub async fn is_shared(&self, id: &str) -> Result<bool, ClientError> {
        let resp = self
            .etcd
            .clone()
            .get(
                format!("{}shared/{id}", model::ROOT_PREFIX),
                Some(GetOptions::new().with_count_only()),
            )
            .await
            .map_err(|e| self.err("reading a shared mark", e))?;
        Ok(resp.count() > 0)
    }

    /// Forgets the shared mark of layout `id` (no entry names it any more).
    pub async fn unmark_shared(&self, id: &str) -> Result<(), ClientError> {
        self.etcd
            .clone()
            .delete(format!("{}shared/{id}", model::ROOT_PREFIX), None)
            .await
            .map_err(|e| self.err("removing a shared mark", e))?;
        Ok(())
    }

    /// Every entry of every share, as (share, path, entry).
    pub async fn all_entries(&self) -> Result<Vec<(String, String, Versioned)>, ClientError> {
        self.entries(model::ns_prefix(), "reading the namespace")
            .await
    }

    async fn range(&self, prefix: String) -> Result<Vec<(String, Versioned)>, ClientError> {
        let all = self.entries(prefix, "listing a directory").await?;
        Ok(all.into_iter().map(|(_, path, v)| (path, v)).collect())
    }

    /// Every entry under `prefix`, as (share, path, entry).
    async fn entries(
        &self,
        prefix: String,
        op: &str,
    ) -> Result<Vec<(String, String, Versioned)>, ClientError> {
        let resp = self
            .etcd
            .clone()
            .get(prefix, Some(GetOptions::new().with_prefix()))
            .await
            .map_err(|e| self.err(op, e))?;
        let mut out = Vec::new();
        for kv in resp.kvs() {
            let Some((share, path)) = kv.key_str().ok().and_then(parse_entry_key) else {
                continue;
            };
            // A client joins these paths onto local directories: a key that is not one
            // spelling of a path below the share (`..`, absolute, empty components) is
            // never listed.
            if !model::valid_share_name(share) || !model::valid_entry_path(path) {
                tracing::warn!(
                    share,
                    path,
                    "ignoring an etcd entry whose key is not a valid path"
                );
                continue;
            }
            out.push((
                share.to_owned(),
                path.to_owned(),
                Versioned {
                    entry: decode(kv.value(), path)?,
                    revision: kv.mod_revision(),
                },
            ));
        }
        Ok(out)
    }

    /// Puts `entry` at `path` if the entry there still has mod revision `expected` (0:
    /// there is none) and the parent directory exists. One etcd transaction.
    pub async fn commit(
        &self,
        share: &str,
        path: &str,
        entry: &Entry,
        expected: i64,
    ) -> Result<Commit, ClientError> {
        self.commit_with(share, path, entry, expected, true).await
    }

    /// [`Meta::commit`]; without the parent check when `parent` is false (an
    /// unpublished subtree, built before its root exists).
    pub async fn commit_with(
        &self,
        share: &str,
        path: &str,
        entry: &Entry,
        expected: i64,
        parent: bool,
    ) -> Result<Commit, ClientError> {
        let key = entry_key(share, path);
        let value = serde_json::to_vec(entry).expect("entry serialises");
        let mut when = vec![Compare::mod_revision(
            key.clone(),
            CompareOp::Equal,
            expected,
        )];
        if let Some((parent, _)) = path.rsplit_once('/').filter(|_| parent) {
            when.push(Compare::version(
                entry_key(share, parent),
                CompareOp::Greater,
                0,
            ));
        }
        let txn = Txn::new()
            .when(when)
            .and_then(vec![TxnOp::put(key, value, None)]);
        let resp = self
            .etcd
            .clone()
            .txn(txn)
            .await
            .map_err(|e| self.err("committing an entry", e))?;
        if !resp.succeeded() {
            return Ok(Commit::Conflict);
        }
        Ok(Commit::Done(
            resp.header().map(|h| h.revision()).unwrap_or_default(),
        ))
    }

    /// Moves the entry at `from` (mod revision `from_rev`) to `to` (mod revision
    /// `to_rev`, 0: absent) as `entry`, if both still have those revisions and the
    /// parent directory of `to` exists: one etcd transaction deletes `from` and puts
    /// `to`, so readers see the name at one place or the other, never both or neither.
    pub async fn rename(
        &self,
        share: &str,
        from: &str,
        from_rev: i64,
        to: &str,
        to_rev: i64,
        entry: &Entry,
    ) -> Result<Commit, ClientError> {
        let (from_key, to_key) = (entry_key(share, from), entry_key(share, to));
        let value = serde_json::to_vec(entry).expect("entry serialises");
        let mut when = vec![
            Compare::mod_revision(from_key.clone(), CompareOp::Equal, from_rev),
            Compare::mod_revision(to_key.clone(), CompareOp::Equal, to_rev),
        ];
        if let Some((parent, _)) = to.rsplit_once('/') {
            when.push(Compare::version(
                entry_key(share, parent),
                CompareOp::Greater,
                0,
            ));
        }
        let txn = Txn::new().when(when).and_then(vec![
            TxnOp::delete(from_key, None),
            TxnOp::put(to_key, value, None),
        ]);
        let resp = self
            .etcd
            .clone()
            .txn(txn)
            .await
            .map_err(|e| self.err("renaming an entry", e))?;
        Ok(if resp.succeeded() {
            Commit::Done(resp.header().map(|h| h.revision()).unwrap_or_default())
        } else {
            Commit::Conflict
        })
    }

    /// Directory `from` of `share` with every key below it, and the target `to`, read
    /// at one revision (one transaction of reads): what [`plan_tree_rename`] plans from.
    ///
    /// [`plan_tree_rename`]: super::tree_rename::plan_tree_rename
    pub async fn read_tree(
        &self,
        share: &str,
        from: &str,
        to: &str,
    ) -> Result<TreeRead, ClientError> {
        let (from_key, to_key) = (entry_key(share, from), entry_key(share, to));
        let txn = Txn::new().and_then(vec![
            TxnOp::get(from_key.clone(), None),
            TxnOp::get(
                children_prefix(share, from),
                Some(GetOptions::new().with_prefix()),
            ),
            TxnOp::get(to_key, None),
            TxnOp::get(
                children_prefix(share, to),
                Some(GetOptions::new().with_prefix().with_count_only()),
            ),
        ]);
        let resp = self
            .etcd
            .clone()
            .txn(txn)
            .await
            .map_err(|e| self.err("reading a directory to rename", e))?;
        let revision = resp.header().map(|h| h.revision()).unwrap_or_default();
        let gets: Vec<etcd_client::GetResponse> = resp
            .op_responses()
            .into_iter()
            .filter_map(|op| match op {
                etcd_client::TxnOpResponse::Get(g) => Some(g),
                _ => None,
            })
            .collect();
        let [src, below, dst, dst_below] = <[_; 4]>::try_from(gets)
            .map_err(|_| ClientError::Cluster("etcd: a short answer to four reads".into()))?;
        let mut keys = Vec::with_capacity(1 + below.kvs().len());
        let mut source = None;
        for kv in src.kvs().iter().chain(below.kvs()) {
            let key = kv.key_str().map_err(|_| {
                ClientError::Cluster(format!("{share}/{from}: a key that is not UTF-8"))
            })?;
            let suffix = key.strip_prefix(&from_key).unwrap_or_default().to_owned();
            if suffix.is_empty() {
                source = Some(decode(kv.value(), from)?);
            }
            keys.push(TreeKey {
                suffix,
                revision: kv.mod_revision(),
                value: kv.value().to_vec(),
            });
        }
        let target = match dst.kvs().first() {
            Some(kv) => Some((decode(kv.value(), to)?, kv.mod_revision())),
            None => None,
        };
        Ok(TreeRead {
            revision,
            source,
            keys,
            target,
            target_below: usize::try_from(dst_below.count()).unwrap_or(usize::MAX),
        })
    }

    /// Sends the directory rename `plan` ([`super::tree_rename`]): one transaction;
    /// [`Commit::Conflict`] if anything it compares changed since it was read.
    pub async fn apply_tree(&self, plan: &TreePlan) -> Result<Commit, ClientError> {
        let when: Vec<Compare> = plan
            .guards
            .iter()
            .map(|g| match g {
                Guard::Revision { key, revision } => {
                    Compare::mod_revision(key.as_str(), CompareOp::Equal, *revision)
                }
                // A range compare holds only if it holds for every key in the range
                // (and, for an empty range, for an absent key: mod revision 0).
                Guard::NotChangedSince { prefix, revision } => {
                    Compare::mod_revision(prefix.as_str(), CompareOp::Less, revision + 1)
                        .with_prefix()
                }
                Guard::NoneBelow { prefix } => {
                    Compare::version(prefix.as_str(), CompareOp::Equal, 0).with_prefix()
                }
                Guard::Exists { key } => Compare::version(key.as_str(), CompareOp::Greater, 0),
            })
            .collect();
        let mut ops: Vec<TxnOp> = plan
            .deletes
            .iter()
            .map(|d| match d {
                Delete::Key(k) => TxnOp::delete(k.as_str(), None),
                Delete::Prefix(p) => TxnOp::delete(
                    p.as_str(),
                    Some(etcd_client::DeleteOptions::new().with_prefix()),
                ),
            })
            .collect();
        ops.extend(
            plan.puts
                .iter()
                .map(|(k, v)| TxnOp::put(k.as_str(), v.clone(), None)),
        );
        let resp = self
            .etcd
            .clone()
            .txn(Txn::new().when(when).and_then(ops))
            .await
            .map_err(|e| self.err("renaming a directory", e))?;
        Ok(if resp.succeeded() {
            Commit::Done(resp.header().map(|h| h.revision()).unwrap_or_default())
        } else {
            Commit::Conflict
        })
    }

    /// Removes the entry at `path` if it still has mod revision `expected`.
    pub async fn remove(
        &self,
        share: &str,
        path: &str,
        expected: i64,
    ) -> Result<Commit, ClientError> {
        let key = entry_key(share, path);
        let txn = Txn::new()
            .when(vec![Compare::mod_revision(
                key.clone(),
                CompareOp::Equal,
                expected,
            )])
            .and_then(vec![TxnOp::delete(key, None)]);
        let resp = self
            .etcd
            .clone()
            .txn(txn)
            .await
            .map_err(|e| self.err("removing an entry", e))?;
        Ok(if resp.succeeded() {
            Commit::Done(resp.header().map(|h| h.revision()).unwrap_or_default())
        } else {
            Commit::Conflict
        })
    }
}

/// The proper ancestors of `path`, nearest first (`a/b/c`: `a/b`, `a`).
pub fn ancestors(path: &str) -> impl Iterator<Item = &str> {
    let mut rest = path;
    std::iter::from_fn(move || {
        let (parent, _) = rest.rsplit_once('/')?;
        rest = parent;
        Some(parent)
    })
}

/// The root directory of every share (not stored).
pub fn root_entry() -> Entry {
    Entry {
        kind: model::EntryKind::Dir,
        mode: 0o755,
        mtime: ferry_common::msg::Timestamp::default(),
        size: 0,
        target: None,
        layout: None,
    }
}

/// The entry etcd holds at `path`, checked ([`Entry::validate`]) before any path is
/// built from it.
fn decode(value: &[u8], path: &str) -> Result<Entry, ClientError> {
    let bad = |e: String| ClientError::Cluster(format!("{path}: bad entry in etcd: {e}"));
    let entry: Entry = serde_json::from_slice(value).map_err(|e| bad(e.to_string()))?;
    entry.validate().map_err(bad)?;
    Ok(entry)
}
