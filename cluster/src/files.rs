//! One file to and from a cluster share.
//!
//! Up: the file's stripes go to the nodes [`placement`] chose, every stripe and every
//! replica in parallel over the nodes' ordinary upload path (the node pulls each
//! window by RDMA READ, checks every chunk, fsyncs, and answers the commit only then);
//! a node that fails is replaced by the next one in the layout's order. Only when
//! every stripe is durable on its replicas is the entry committed, in one etcd
//! transaction that compares the entry's revision: readers see the old file or the
//! new one, never a mix.
//!
//! Down: every stripe is fetched from its first live replica into one staged local
//! file (resumable, as single-server downloads are), and its manifest is compared
//! with the layout's; a replica that fails or holds other bytes is passed over for
//! the next.
//!
//! Both ways, every stripe transfer on a node runs under the progress deadline of
//! [`super::health`]: a node that fails or stalls is suspected (its session dropped)
//! and the stripe moves on, a read to the next replica, a write to the next node in
//! the layout's order; suspect nodes are placed on and read from last.

use std::collections::VecDeque;
use std::fs;
use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::sync::Arc;

use crate::model::{
    object_path, placement, stripe_count, stripe_range, Entry, EntryKind, Layout, ShareConfig,
    Stripe, STORE_SHARE,
};
use ferry_common::msg::{ErrorKind, Hash256, HashAlgorithm, RemoteError};
use ferry_common::seal::to_hex;
use tokio::task::JoinSet;

use super::health::Progress;
use super::meta::{Commit, Versioned};
use super::Cluster;
use ferry_client::error::ClientError;
use ferry_client::transfer::{self, Assembly, Copied, Part, ProgressFn};

/// Times a commit is tried again after another writer changed the entry.
pub(super) const COMMIT_TRIES: usize = 16;

/// True for failures that are the node's (or its link's), after which another node is
/// tried; the others (a local file that cannot be read, bad usage) end the file.
fn node_failure(e: &ClientError) -> bool {
    !matches!(
        e,
        ClientError::Local { .. } | ClientError::SourceChanged { .. } | ClientError::Usage(_)
    )
}

fn remote(kind: ErrorKind, message: String) -> ClientError {
    ClientError::Remote(RemoteError { kind, message })
}

/// The tag naming a file version for resumed downloads: its layout id and size.
fn version_tag(layout: &Layout, size: u64) -> [u8; 32] {
    use sha2::{Digest, Sha256};
    let mut h = Sha256::new();
    h.update(b"ferry cluster version v1");
    h.update(layout.id.as_bytes());
    h.update(size.to_le_bytes());
    h.finalize().into()
}

/// The layout id of `path` of `share` written from the local file `md` describes: a
/// function of the destination and the source's identity (device, inode, size,
/// mtime, ctime), so that the same copy run again after an interruption finds the
/// stripes it already wrote (each checked by its manifest before it is reused).
fn layout_id(share: &str, path: &str, md: &fs::Metadata) -> String {
    use sha2::{Digest, Sha256};
    let mut h = Sha256::new();
    h.update(b"ferry cluster layout v1\0");
    h.update(share.as_bytes());
    h.update([0]);
    h.update(path.as_bytes());
    h.update([0]);
    for v in [
        md.dev(),
        md.ino(),
        md.size(),
        md.mtime() as u64,
        md.mtime_nsec() as u64,
        md.ctime() as u64,
        md.ctime_nsec() as u64,
    ] {
        h.update(v.to_le_bytes());
    }
    to_hex(&h.finalize()[..16])
}

/// If node `c` already holds `object` with the bytes of `range` of `local` (an
/// interrupted copy wrote it), what an upload would have returned; `None` otherwise.
async fn held(
    c: &crate::Client,
    object: &str,
    local: &Path,
    range: std::ops::Range<u64>,
) -> Option<transfer::Uploaded> {
    let (version, _) = c
        .manifest(STORE_SHARE, object, c.welcome().chunk_bytes)
        .await
        .ok()?;
    let len = range.end - range.start;
    if version.size != len {
        return None;
    }
    let local = local.to_owned();
    let (algorithm, chunk) = (version.algorithm, version.chunk_bytes);
    let mine = tokio::task::spawn_blocking(move || hash_range(&local, range, algorithm, chunk))
        .await
        .ok()?
        .ok()?;
    if mine != version.manifest {
        return None;
    }
    // gc counts its grace period from an object's last change: a reused object must
    // look as young as a new upload's, or a gc could collect it before this copy
    // commits the layout that names it. Gone meanwhile: it is uploaded anew.
    refresh(c, object).await.ok()?;
    Some(transfer::Uploaded {
        copied: Copied {
            bytes: len,
            bytes_sent: 0,
            bytes_reused: len,
        },
        manifest: mine,
        algorithm,
    })
}

/// Moves the ctime of `object` on node `c` to the node's now (its mode set to itself),
/// so that gc's grace period starts again ([`crate::model::gc`]).
async fn refresh(c: &crate::Client, object: &str) -> Result<(), ClientError> {
    let attr = c.stat(STORE_SHARE, object, false).await?;
    c.set_attr(STORE_SHARE, object, Some(attr.mode), None).await
}

/// The manifest id of bytes `range` of `path` in chunks of `chunk` bytes.
fn hash_range(
    path: &Path,
    range: std::ops::Range<u64>,
    algorithm: HashAlgorithm,
    chunk: u32,
) -> std::io::Result<Hash256> {
    use std::os::unix::fs::FileExt;
    let f = fs::File::open(path)?;
    let mut buf = vec![0u8; chunk as usize];
    let mut hashes = Vec::new();
    let mut at = range.start;
    while at < range.end {
        let n = (range.end - at).min(u64::from(chunk)) as usize;
        f.read_exact_at(&mut buf[..n], at)?;
        hashes.extend(ferry_common::chunk::hash_chunks(algorithm, &buf[..n], n));
        at += n as u64;
    }
    Ok(ferry_common::chunk::manifest_id(
        algorithm,
        range.end - range.start,
        chunk,
        &hashes,
    ))
}

/// How [`Cluster::put_version`] makes and commits a new version.
pub struct Version<'a> {
    /// Committed where readers see it (false: into a snapshot being built).
    pub visible: bool,
    /// The older version and which of its stripes the new one keeps (their bytes are
    /// the same, at the same place): their objects are named, not sent. Their bytes
    /// need not be in the local file.
    pub base: Option<(&'a Layout, &'a [bool])>,
    /// What the commit replaces.
    pub expect: Expect<'a>,
}

/// What a new version's commit may replace.
pub enum Expect<'a> {
    /// Whatever is there: the last writer wins.
    Any,
    /// Only this entry, at its revision (`None`: only no entry). A version that keeps
    /// stripes of an older one commits only over the entry it checked names them, so
    /// that no writer removed them meanwhile.
    Over(Option<&'a Versioned>),
}

/// How [`Cluster::put_version`] ended.
pub enum Outcome {
    /// Committed.
    Done(Put),
    /// The entry changed since it was read ([`Expect::Over`]): nothing committed.
    Conflict,
    /// The nodes now hash in another algorithm than the kept stripes': nothing
    /// committed; send every stripe.
    OtherAlgorithm,
}

/// What a new version's upload moved.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Put {
    /// Bytes, as for any copy (kept stripes' bytes counted as reused).
    pub copied: Copied,
    /// Stripes uploaded.
    pub stripes_sent: u64,
    /// Stripes whose older object the new version names instead.
    pub stripes_reused: u64,
}

impl Put {
    /// The tally of `layout` (a file of `size` bytes) whose stripes were sent as `sent`.
    fn count(size: u64, layout: &Layout, sent: &[Option<PutStripe>]) -> Put {
        let mut put = Put {
            copied: Copied {
                bytes: size,
                ..Copied::default()
            },
            ..Put::default()
        };
        for (i, s) in sent.iter().enumerate() {
            match s {
                Some(s) => {
                    put.stripes_sent += 1;
                    put.copied.bytes_sent += s.copied.bytes_sent;
                    put.copied.bytes_reused += s.copied.bytes_reused;
                }
                None => {
                    put.stripes_reused += 1;
                    let r = layout.stripe_range(size, i);
                    put.copied.bytes_reused += r.end - r.start;
                }
            }
        }
        put
    }
}

/// The layout `id` of the stripes `sent` (`None`: kept from `base`); `None` if their
/// algorithms differ.
fn assemble(
    id: &str,
    stripe_bytes: u64,
    base: Option<(&Layout, &[bool])>,
    sent: &[Option<PutStripe>],
) -> Option<Layout> {
    let mut algorithms = sent.iter().flatten().map(|s| s.algorithm);
    let algorithm = match base {
        Some((b, _)) if sent.iter().any(Option::is_none) => b.algorithm,
        _ => algorithms.next().unwrap_or(HashAlgorithm::SUPPORTED[0]),
    };
    if algorithms.any(|a| a != algorithm) {
        return None;
    }
    let stripes = sent
        .iter()
        .enumerate()
        .map(|(i, s)| match (s, base) {
            (Some(s), _) => Some(s.stripe.clone()),
            (None, Some((b, _))) => b.reused_by(i, id),
            (None, None) => None,
        })
        .collect::<Option<Vec<Stripe>>>()?;
    Some(Layout {
        id: id.to_owned(),
        algorithm,
        stripe_bytes,
        stripes,
    })
}

/// The metadata of `local`, a regular file to upload.
fn source_file(local: &Path) -> Result<fs::Metadata, ClientError> {
    let md = fs::metadata(local).map_err(|e| ClientError::local(local, "cannot stat", e))?;
    if !md.is_file() {
        return Err(ClientError::local(
            local,
            "cannot upload",
            std::io::Error::other("not a regular file"),
        ));
    }
    Ok(md)
}

/// One stripe as uploaded.
struct PutStripe {
    stripe: Stripe,
    algorithm: HashAlgorithm,
    copied: Copied,
    /// The holders whose copy was already there (an earlier, interrupted run's),
    /// checked again before the layout is committed.
    reused: Vec<String>,
}

impl Cluster {
    /// Uploads the local regular file `local` to `path` of cluster share `share` with
    /// `config`'s stripes and replicas, replacing what is there (unless it is a
    /// directory). Returns what moved (`bytes_sent` counts every replica).
    pub async fn put_file(
        &self,
        local: &Path,
        share: &str,
        path: &str,
        config: ShareConfig,
        progress: ProgressFn,
    ) -> Result<Copied, ClientError> {
        self.put_file_at(local, share, path, config, progress, true)
            .await
    }

    /// [`Cluster::put_file`]; with `visible` false, into a subtree whose root is not
    /// published yet (a snapshot being built): the parent is not required to exist.
    pub async fn put_file_at(
        &self,
        local: &Path,
        share: &str,
        path: &str,
        config: ShareConfig,
        progress: ProgressFn,
        visible: bool,
    ) -> Result<Copied, ClientError> {
        let how = Version {
            visible,
            base: None,
            expect: Expect::Any,
        };
        match self
            .put_version(local, (share, path), config, progress, how)
            .await?
        {
            Outcome::Done(put) => Ok(put.copied),
            // Committed over whatever is there: no conflict; no stripe kept.
            Outcome::Conflict | Outcome::OtherAlgorithm => Err(ClientError::Cluster(format!(
                "{share}/{path}: the storage nodes hash in different algorithms"
            ))),
        }
    }

    /// [`Cluster::put_file`], reusing the objects of every stripe of the file there now
    /// whose bytes the local file has too at the same place (the chunk manifests
    /// deciding): only the other stripes are sent (copy-on-write per stripe). The new
    /// version is committed only over the entry it was compared with; another
    /// writer's commit meanwhile makes it compare again.
    pub async fn put_file_reusing(
        &self,
        local: &Path,
        at: (&str, &str),
        config: ShareConfig,
        progress: ProgressFn,
    ) -> Result<Put, ClientError> {
        self.put_staged(local, at, config, progress, None).await
    }

    /// Which stripes of `local` (`sizes.1` bytes) hold exactly the bytes of the same
    /// stripe of `layout` (a file of `sizes.0` bytes): same stripe size, same range,
    /// same manifest in the layout's algorithm and the nodes' chunk size.
    /// Stripes `skip` says are not local are not read (false for them).
    pub(super) async fn same_stripes(
        &self,
        local: &Path,
        layout: &Layout,
        (old_size, size): (u64, u64),
        config: ShareConfig,
        skip: &[bool],
    ) -> Result<Vec<bool>, ClientError> {
        let sb = layout.stripe_bytes;
        let count = stripe_count(size, sb);
        let mut keep = vec![false; count];
        if sb != config.stripe_bytes || layout.stripes.is_empty() {
            return Ok(keep);
        }
        let Ok(chunk) = self.chunk_bytes(&layout.stripes[0].replicas).await else {
            return Ok(keep);
        };
        for (i, k) in keep.iter_mut().enumerate().take(layout.stripes.len()) {
            if skip.get(i).copied().unwrap_or(false) {
                continue;
            }
            let range = stripe_range(size, sb, i);
            if range != stripe_range(old_size, sb, i) {
                continue;
            }
            let (file, algorithm) = (local.to_owned(), layout.algorithm);
            let mine =
                tokio::task::spawn_blocking(move || hash_range(&file, range, algorithm, chunk))
                    .await
                    .map_err(|e| ClientError::Cluster(format!("hashing: {e}")))?
                    .map_err(|e| ClientError::local(local, "cannot read", e))?;
            *k = layout.manifest(i) == Some(mine);
        }
        Ok(keep)
    }

    /// Uploads `local` as a new version of `path` of `share` (the stripes `how.base`
    /// keeps are not sent: the new layout names their objects) and commits it as
    /// `how.expect` says; the objects of the version it replaced that the new one does
    /// not name are removed (unless a backup shares them).
    pub async fn put_version(
        &self,
        local: &Path,
        (share, path): (&str, &str),
        config: ShareConfig,
        progress: ProgressFn,
        how: Version<'_>,
    ) -> Result<Outcome, ClientError> {
        let md = source_file(local)?;
        let size = md.len();
        if let Some(v) = self.meta().entry(share, path).await? {
            if v.entry.kind == EntryKind::Dir {
                return Err(remote(
                    ErrorKind::IsADirectory,
                    format!("{share}/{path}: is a directory"),
                ));
            }
        }
        let id = layout_id(share, path, &md);
        let skip: Vec<bool> = how.base.map(|(_, k)| k.to_vec()).unwrap_or_default();
        let sent = self
            .put_stripes(local, (share, path, &id), size, config, progress, &skip)
            .await?;
        let sent = self
            .recheck_reused(local, share, &id, size, config, sent)
            .await?;
        let Some(layout) = assemble(&id, config.stripe_bytes, how.base, &sent) else {
            return Ok(Outcome::OtherAlgorithm);
        };
        let put = Put::count(size, &layout, &sent);
        let entry = Entry {
            kind: EntryKind::File,
            mode: md.mode() & 0o7777,
            mtime: ferry_common::attr::attr_of(&md, None).mtime,
            size,
            target: None,
            layout: Some(layout),
        };
        let replaced = match how.expect {
            Expect::Any => {
                self.commit_entry_with(share, path, &entry, how.visible)
                    .await?
            }
            Expect::Over(current) => {
                let rev = current.map_or(0, |v| v.revision);
                match self.meta().commit(share, path, &entry, rev).await? {
                    Commit::Done(_) => current.map(|v| v.entry.clone()),
                    Commit::Conflict => return Ok(Outcome::Conflict),
                }
            }
        };
        if let (Some(old), Some(new)) = (replaced.and_then(|e| e.layout), &entry.layout) {
            self.remove_replaced(share, &old, new).await;
        }
        Ok(Outcome::Done(put))
    }

    /// Places the stripes of the `size` bytes of `local` (layout `id`, to be `path` of
    /// `share`) on the nodes and uploads them, each to its replicas: all of them, in
    /// order, or the first error (the others are then stopped).
    async fn put_stripes(
        &self,
        local: &Path,
        (share, path, id): (&str, &str, &str),
        size: u64,
        config: ShareConfig,
        progress: ProgressFn,
        skip: &[bool],
    ) -> Result<Vec<Option<PutStripe>>, ClientError> {
        let count = stripe_count(size, config.stripe_bytes);
        let nodes = self.usable_nodes();
        let need = config.stripe_bytes.min(size).max(1);
        let placed = placement::place(id, count, config.replicas.into(), &nodes, need)
            .map_err(|e| ClientError::Cluster(format!("{share}/{path}: {e}")))?;
        let mut tasks = JoinSet::new();
        for (i, replicas) in placed.into_iter().enumerate() {
            if skip.get(i).copied().unwrap_or(false) {
                continue;
            }
            // Each node works on STRIPES_PER_NODE stripes at a time (over every
            // file of this run), so every link stays busy until its queue is empty.
            let limit = self.node_slots(&replicas[0]);
            let (cluster, local, share, id, progress) = (
                self.clone(),
                local.to_owned(),
                share.to_owned(),
                id.to_owned(),
                progress.clone(),
            );
            let range = stripe_range(size, config.stripe_bytes, i);
            let want = usize::from(config.replicas);
            tasks.spawn(async move {
                let _permit = limit.acquire_owned().await;
                let r = cluster
                    .put_stripe(&local, &share, &id, i, range, replicas, want, progress)
                    .await;
                (i, r)
            });
        }
        let mut stripes: Vec<Option<PutStripe>> = (0..count).map(|_| None).collect();
        let mut first_err = None;
        while let Some(joined) = tasks.join_next().await {
            match joined {
                Ok((i, Ok(s))) => stripes[i] = Some(s),
                Ok((_, Err(e))) => {
                    first_err.get_or_insert(e);
                    tasks.abort_all();
                }
                Err(e) if e.is_cancelled() => {}
                Err(e) => {
                    first_err.get_or_insert(ClientError::Cluster(format!("stripe task: {e}")));
                }
            }
        }
        if let Some(e) = first_err {
            // The objects already written are named by no layout (never read): a
            // re-run reuses them, else `ferry cluster gc` removes them.
            return Err(e);
        }
        Ok(stripes)
    }

    /// Commits `entry` at `path`, replacing whatever file or symlink is there (a
    /// concurrent writer's included: the last commit wins, whole). Returns the entry
    /// it replaced.
    pub async fn commit_entry(
        &self,
        share: &str,
        path: &str,
        entry: &Entry,
    ) -> Result<Option<Entry>, ClientError> {
        self.commit_entry_with(share, path, entry, true).await
    }

    /// [`Cluster::commit_entry`]; without requiring the parent when `visible` is
    /// false (see [`Cluster::put_file_at`]).
    pub async fn commit_entry_with(
        &self,
        share: &str,
        path: &str,
        entry: &Entry,
        visible: bool,
    ) -> Result<Option<Entry>, ClientError> {
        for _ in 0..COMMIT_TRIES {
            let current = if visible {
                self.meta().entry(share, path).await?
            } else {
                self.meta()
                    .below_all(share, path.rsplit_once('/').map_or("", |(p, _)| p))
                    .await?
                    .into_iter()
                    .find(|(p, _)| p == path)
                    .map(|(_, v)| v)
            };
            let expected = current.as_ref().map_or(0, |v| v.revision);
            if let Some(v) = &current {
                if v.entry.kind == EntryKind::Dir && entry.kind != EntryKind::Dir {
                    return Err(remote(
                        ErrorKind::IsADirectory,
                        format!("{share}/{path}: is a directory"),
                    ));
                }
            }
            match self
                .meta()
                .commit_with(share, path, entry, expected, visible)
                .await?
            {
                Commit::Done(_) => return Ok(current.map(|v| v.entry)),
                Commit::Conflict => self.parent_exists(share, path).await?,
            }
        }
        Err(ClientError::Cluster(format!(
            "{share}/{path}: changed by other writers {COMMIT_TRIES} times in a row; not written"
        )))
    }

    /// After a failed compare-and-swap at `path`: NotFound if its parent directory is
    /// gone (the commit's other condition), else the entry changed (try again).
    pub(super) async fn parent_exists(&self, share: &str, path: &str) -> Result<(), ClientError> {
        let parent = path.rsplit_once('/').map(|(p, _)| p).unwrap_or("");
        if self.meta().entry(share, parent).await?.is_none() {
            return Err(remote(
                ErrorKind::NotFound,
                format!("{share}/{parent}: no such directory"),
            ));
        }
        Ok(())
    }

    /// Removes the own objects of `layout` (see [`Cluster::remove_objects`]) unless
    /// another entry may name them (a backup's link marked the layout shared: such
    /// objects go when retention finds them unnamed).
    pub async fn remove_unshared(&self, share: &str, layout: &Layout) {
        self.remove_replaced_but(share, layout, &|_| false).await
    }

    /// Removes the own objects of `old`, replaced by `new`, that `new` does not name
    /// (the stripes it reuses stay), unless a backup shares `old`.
    pub async fn remove_replaced(&self, share: &str, old: &Layout, new: &Layout) {
        if old.id != new.id {
            self.remove_replaced_but(share, old, &|o| new.names(share, o))
                .await
        }
    }

    async fn remove_replaced_but(
        &self,
        share: &str,
        layout: &Layout,
        keep: &(dyn Fn(&str) -> bool + Sync),
    ) {
        match self.meta().is_shared(&layout.id).await {
            Ok(false) => self.remove_objects(share, layout, keep).await,
            Ok(true) => {}
            Err(e) => tracing::debug!("cannot tell whether a layout is shared: {e}"),
        }
    }

    /// Removes the objects `layout` owns (not those it reuses from an older version:
    /// another version, a snapshot's, may name them; `ferry cluster gc` takes them
    /// when none does), except those `keep` names, from the nodes that hold them
    /// (best effort: what a dead node keeps is named by no layout and never read).
    pub async fn remove_objects(
        &self,
        share: &str,
        layout: &Layout,
        keep: &(dyn Fn(&str) -> bool + Sync),
    ) {
        for (i, s) in layout.stripes.iter().enumerate() {
            let object = layout.object_path(share, i);
            if !layout.is_own(i) || keep(&object) {
                continue;
            }
            for node in &s.replicas {
                // A suspect node's copies stay: named by no layout, never read.
                if !self.is_live(node) || self.is_suspect(node) {
                    continue;
                }
                if let Ok(c) = self.session(node).await {
                    if let Err(e) = c.remove(STORE_SHARE, &object, false).await {
                        tracing::debug!(node, object, "cannot remove a replaced object: {e}");
                    }
                }
            }
        }
    }

    #[allow(clippy::too_many_arguments)]
    async fn put_stripe(
        &self,
        local: &Path,
        share: &str,
        id: &str,
        index: usize,
        range: std::ops::Range<u64>,
        placed: Vec<String>,
        want: usize,
        progress: ProgressFn,
    ) -> Result<PutStripe, ClientError> {
        let object = object_path(share, id, index);
        let mut tried: Vec<String> = Vec::new();
        let mut holders: Vec<String> = Vec::new();
        let mut result: Option<(Hash256, HashAlgorithm)> = None;
        let mut copied = Copied::default();
        let mut reused = Vec::new();
        let mut queue: VecDeque<String> = placed.into();
        let mut last_err = None;
        while holders.len() < want {
            let need = range.end - range.start;
            let Some(batch) = self.next_batch(id, &mut queue, &mut tried, need) else {
                break;
            };
            let mut set = JoinSet::new();
            for (k, node) in batch.into_iter().enumerate() {
                tried.push(node.clone());
                // Progress counts the first copy of each stripe only.
                let progress = if k == 0 && holders.is_empty() {
                    progress.clone()
                } else {
                    transfer_quiet()
                };
                let (local, object) = (local.to_owned(), object.clone());
                set.spawn(
                    self.clone()
                        .put_on(node, local, object, range.clone(), progress),
                );
            }
            while let Some(joined) = set.join_next().await {
                let Ok((node, r)) = joined else { continue };
                match r {
                    Ok(up) => {
                        match result {
                            None => result = Some((up.manifest, up.algorithm)),
                            Some(m) if m != (up.manifest, up.algorithm) => {
                                return Err(ClientError::SourceChanged {
                                    path: local.to_owned(),
                                })
                            }
                            Some(_) => {}
                        }
                        copied.bytes_sent += up.copied.bytes_sent;
                        copied.bytes_reused += up.copied.bytes_reused;
                        if up.copied.bytes_sent == 0 {
                            reused.push(node.clone());
                        }
                        holders.push(node);
                    }
                    Err(e) if node_failure(&e) => {
                        self.passed_over(&node, &e).await;
                        last_err = Some(e);
                    }
                    Err(e) => return Err(e),
                }
            }
        }
        let Some((manifest, algorithm)) = result else {
            return Err(match last_err {
                Some(e) => ClientError::Cluster(format!(
                    "stripe {index}: no storage node took it (last: {e})"
                )),
                None => ClientError::Cluster(format!("stripe {index}: no storage node alive")),
            });
        };
        if holders.len() < want {
            tracing::warn!(
                object,
                replicas = holders.len(),
                want,
                "stripe written with fewer replicas than the share asks; `ferry cluster repair` adds the others"
            );
        }
        Ok(PutStripe {
            stripe: Stripe {
                replicas: holders,
                manifest: to_hex(&manifest),
                object: None,
            },
            algorithm,
            copied,
            reused,
        })
    }

    /// Checks, just before the commit, that every object reused from an earlier run is
    /// still on its node (a gc with a grace period shorter than this copy may have
    /// collected it); a stripe that lost one is uploaded again.
    async fn recheck_reused(
        &self,
        local: &Path,
        share: &str,
        id: &str,
        size: u64,
        config: ShareConfig,
        mut stripes: Vec<Option<PutStripe>>,
    ) -> Result<Vec<Option<PutStripe>>, ClientError> {
        for (i, s) in stripes.iter_mut().enumerate() {
            let Some(s) = s else { continue };
            let object = object_path(share, id, i);
            let mut missing = false;
            for node in &s.reused {
                let there = match self.session(node).await {
                    Ok(c) => c.stat(STORE_SHARE, &object, false).await.is_ok(),
                    Err(_) => false,
                };
                missing |= !there;
            }
            if missing {
                tracing::info!(object, "a reused object is gone; uploading it again");
                let range = stripe_range(size, config.stripe_bytes, i);
                let placed = s.stripe.replicas.clone();
                let want = usize::from(config.replicas);
                let quiet = transfer_quiet();
                *s = self
                    .put_stripe(local, share, id, i, range, placed, want, quiet)
                    .await?;
            }
        }
        Ok(stripes)
    }

    /// Downloads the file `entry` (at `path` of `share`) to the local path `dest`,
    /// with its mode and mtime.
    pub async fn get_file(
        &self,
        share: &str,
        path: &str,
        entry: &Entry,
        dest: &Path,
        progress: ProgressFn,
    ) -> Result<Copied, ClientError> {
        let size = entry.size;
        let empty = Layout {
            id: String::new(),
            algorithm: HashAlgorithm::SUPPORTED[0],
            stripe_bytes: crate::model::DEFAULT_STRIPE_BYTES,
            stripes: Vec::new(),
        };
        let layout = entry.layout.as_ref().unwrap_or(&empty);
        let count = stripe_count(size, layout.stripe_bytes);
        if layout.stripes.len() != count {
            return Err(ClientError::Cluster(format!(
                "{share}/{path}: the layout has {} stripes for {size} bytes",
                layout.stripes.len()
            )));
        }
        let chunk = match layout.stripes.first() {
            Some(s) => self.chunk_bytes(&s.replicas).await?,
            None => ferry_common::msg::DEFAULT_CHUNK_BYTES,
        };
        let asm = Arc::new(
            Assembly::open(
                dest,
                size,
                chunk,
                layout.algorithm,
                version_tag(layout, size),
            )
            .await?,
        );
        let reused = asm.held_bytes();
        let mut tasks = JoinSet::new();
        for i in 0..count {
            let first = self
                .read_order(&layout.stripes[i].replicas)
                .into_iter()
                .next()
                .unwrap_or_default();
            let limit = self.node_slots(&first);
            let (cluster, share, layout, asm, progress) = (
                self.clone(),
                share.to_owned(),
                layout.clone(),
                asm.clone(),
                progress.clone(),
            );
            tasks.spawn(async move {
                let _permit = limit.acquire_owned().await;
                let into = Part::Assembly(&asm);
                cluster
                    .get_stripe(&share, &layout, i, size, into, progress)
                    .await
            });
        }
        let mut sent = 0;
        let mut first_err = None;
        while let Some(joined) = tasks.join_next().await {
            match joined {
                Ok(Ok(n)) => sent += n,
                Ok(Err(e)) => {
                    first_err.get_or_insert(e);
                    tasks.abort_all();
                }
                Err(e) if e.is_cancelled() => {}
                Err(e) => {
                    first_err.get_or_insert(ClientError::Cluster(format!("stripe task: {e}")));
                }
            }
        }
        let asm = Arc::into_inner(asm).expect("every stripe task has ended");
        if let Some(e) = first_err {
            if !matches!(
                e,
                ClientError::Disconnected(_)
                    | ClientError::Transport(_)
                    | ClientError::Hung { .. }
                    | ClientError::Stalled { .. }
            ) {
                asm.discard();
            }
            return Err(e);
        }
        asm.finish(entry.mode, entry.mtime).await?;
        Ok(Copied {
            bytes: size,
            bytes_sent: sent,
            bytes_reused: reused,
        })
    }

    /// The nodes to write a stripe to next: first the placed ones (`queue`) all at once,
    /// a suspect one passed over untried; then replacements one by one, the next in
    /// the file's order not yet `tried`. `None` when no node is left.
    fn next_batch(
        &self,
        id: &str,
        queue: &mut VecDeque<String>,
        tried: &mut Vec<String>,
        need: u64,
    ) -> Option<Vec<String>> {
        if !queue.is_empty() {
            let (good, suspect): (Vec<String>, Vec<String>) =
                queue.drain(..).partition(|n| !self.is_suspect(n));
            tried.extend(suspect);
            if !good.is_empty() {
                return Some(good);
            }
        }
        let usable = self.usable_nodes();
        placement::next_replica(id, &usable, tried, need).map(|n| vec![n.id.clone()])
    }

    /// One stripe's upload (bytes `range` of `local`, as `object`) to `node`, reused if
    /// the node already holds it, under the progress deadline; gives the node back with
    /// the outcome.
    async fn put_on(
        self,
        node: String,
        local: std::path::PathBuf,
        object: String,
        range: std::ops::Range<u64>,
        progress: ProgressFn,
    ) -> (String, Result<transfer::Uploaded, ClientError>) {
        let op = |p: Progress| {
            let (cluster, node, object, local) = (&self, &node, &object, &local);
            async move {
                let c = cluster.session(node).await?;
                p.attach(&c);
                if let Some(held) = held(&c, object, local, range.clone()).await {
                    progress(held.copied.bytes);
                    return Ok(held);
                }
                cluster.object_dir(node, &c, object).await?;
                let progress = p.wrap(progress);
                transfer::upload_range(&c, local, range, STORE_SHARE, object, progress).await
            }
        };
        let r = self.watched(&node, op).await;
        (node, r)
    }

    /// A node failed (or stalled) an operation: it is suspect, unless the stall
    /// already made it so.
    async fn passed_over(&self, node: &str, e: &ClientError) {
        if !matches!(e, ClientError::Stalled { .. }) {
            self.suspect(node, e).await;
        }
    }

    /// The chunk size of the first of `nodes` that answers.
    async fn chunk_bytes(&self, nodes: &[String]) -> Result<u32, ClientError> {
        let mut last = None;
        for node in self.read_order(nodes) {
            match self.session(&node).await {
                Ok(c) => return Ok(c.welcome().chunk_bytes),
                Err(e) => {
                    self.suspect(&node, &e).await;
                    last = Some(e);
                }
            }
        }
        Err(ClientError::Cluster(match last {
            Some(e) => format!("no replica's node answers (last: {e})"),
            None => "no replica's node is alive".into(),
        }))
    }

    /// `replicas` in the order to read from: live nodes that are not suspect first (in
    /// the layout's order), then the suspect ones.
    fn read_order(&self, replicas: &[String]) -> Vec<String> {
        self.health()
            .read_order(replicas, |n| self.is_live(n), std::time::Instant::now())
    }

    /// Stripe `index` of `layout` (a file of `size` bytes of `share`) into `into`, from
    /// the first replica in read order whose copy arrives whole with the layout's
    /// manifest (every chunk verified as it arrives); the bytes that crossed.
    pub(super) async fn get_stripe(
        &self,
        share: &str,
        layout: &Layout,
        index: usize,
        size: u64,
        into: Part<'_>,
        progress: ProgressFn,
    ) -> Result<u64, ClientError> {
        let range = stripe_range(size, layout.stripe_bytes, index);
        let object = layout.object_path(share, index);
        let want = layout.manifest(index).ok_or_else(|| {
            ClientError::Cluster(format!("stripe {index}: bad manifest in the layout"))
        })?;
        let mut last = None;
        for node in self.read_order(&layout.stripes[index].replicas) {
            let op = |p: Progress| {
                let (node, object, range) = (&node, &object, range.clone());
                let progress = p.wrap(progress.clone());
                async move {
                    let c = self.session(node).await?;
                    p.attach(&c);
                    let len = range.end - range.start;
                    transfer::download_range(
                        &c,
                        STORE_SHARE,
                        object,
                        into,
                        range.start,
                        len,
                        progress,
                    )
                    .await
                }
            };
            let r = self.watched(&node, op).await;
            match r {
                Ok(got) if got.manifest == want && got.algorithm == layout.algorithm => {
                    return Ok(got.bytes_sent)
                }
                Ok(_) => {
                    // A copy with other bytes: stale or damaged. Never served.
                    let e = ClientError::Integrity {
                        what: format!("node {node}: {STORE_SHARE}/{object}"),
                        chunk: 0,
                    };
                    tracing::warn!(
                        node,
                        object,
                        "replica does not match the layout's manifest; reading another"
                    );
                    last = Some(e);
                }
                Err(e) if node_failure(&e) => {
                    self.passed_over(&node, &e).await;
                    last = Some(e);
                }
                Err(e) => return Err(e),
            }
        }
        Err(ClientError::Cluster(match last {
            Some(e) => format!("stripe {index}: no replica could be read (last: {e})"),
            None => format!(
                "stripe {index}: every node holding it ({}) is down",
                layout.stripes[index].replicas.join(", ")
            ),
        }))
    }
}

/// A progress function that counts nothing.
fn transfer_quiet() -> ProgressFn {
    ferry_client::progress::no_progress()
}
