//! Writes through a cluster mount: close-to-open, whole files, as the single-server
//! mount's staged files.
//!
//! ```text
//!  create / open for writing ──> a staging file of this handle in the mount's private
//!        directory (an existing file opened without O_TRUNC: of its size, nothing
//!        fetched; [`super::staged`] fetches a stripe when a write needs its bytes)
//!  write, read, fstat, truncate on the handle ──> the staging file (and the version
//!        opened, for the stripes not fetched)
//!  flush (close) / fsync of a changed handle ──> Cluster::put_staged: the stripes not
//!        fetched and those whose bytes did not change name the objects of the
//!        version there now (only where it names the same ones as the version opened:
//!        [`ferry_cluster::partial`]), the changed ones go to their nodes,
//!        then the entry by compare-and-swap: the new version appears whole, at once;
//!        a failure answers EIO and publishes nothing
//!  mkdir, rmdir, unlink, symlink, rename, chmod, utimens ──> one etcd transaction each,
//!        comparing the revision read (rename: both names' revisions)
//! ```
//!
//! Invariants: a file written through the mount is visible to others only once a
//! close or fsync published it, whole; every path the mount changes is dropped from
//! its entry cache; a directory is renamed with everything below it in one transaction
//! ([`super::rename`]).

use std::fs::{File, OpenOptions};
use std::os::unix::fs::PermissionsExt;
use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use ferry_client::transfer::ProgressFn;
use ferry_client::ClientError;
use ferry_cluster::meta::Commit;
use ferry_cluster::model::{Entry, EntryKind, ShareConfig};
use ferry_cluster::partial::Unfetched;
use ferry_cluster::Cluster;
use ferry_common::msg::Timestamp;
use fuser::{Errno, INodeNo, TimeOrNow};

use super::staged::{Base, Presence, Source, Staged};
use super::Inner;
use crate::nodes::join;
use crate::remote::{errno_of, lock, OpError};

/// Compare-and-swap attempts before a change gives up (others kept changing it).
pub(super) const TRIES: usize = 10;

/// What a writable cluster mount needs besides the read path.
pub struct Writer {
    /// The cluster: etcd and a session per storage node.
    pub cluster: Cluster,
    /// The share's stripes and replicas, for the files written.
    pub config: ShareConfig,
    /// The private directory of the staging files (removed at unmount).
    pub dir: PathBuf,
}

impl Drop for Writer {
    fn drop(&mut self) {
        self.remove_staging();
    }
}

impl Writer {
    /// Removes the staging directory and whatever is left in it (at unmount).
    pub fn remove_staging(&self) {
        if let Err(e) = std::fs::remove_dir_all(&self.dir) {
            if e.kind() != std::io::ErrorKind::NotFound {
                tracing::warn!("{}: {e}", self.dir.display());
            }
        }
    }
}

/// A staging file made for a handle, before it is registered.
struct Staging {
    local: PathBuf,
    file: File,
    base: Option<Base>,
    presence: Presence,
}

impl Staging {
    fn into_staged(self, path: String, dirty: bool, opener: Option<u32>) -> Staged {
        Staged::new(
            path,
            (self.local, self.file),
            self.base,
            self.presence,
            dirty,
            opener,
        )
    }
}

fn system_time(t: TimeOrNow) -> SystemTime {
    match t {
        TimeOrNow::SpecificTime(t) => t,
        TimeOrNow::Now => SystemTime::now(),
    }
}

fn local_err(path: &std::path::Path, e: std::io::Error) -> OpError {
    OpError::new(Errno::EIO, format!("staging file {}: {e}", path.display()))
}

fn no_progress() -> ProgressFn {
    Arc::new(|_| {})
}

fn utf8(name: &std::ffi::OsStr) -> Result<&str, OpError> {
    name.to_str()
        .ok_or_else(|| OpError::new(Errno::EINVAL, "name is not UTF-8"))
}

fn now() -> Timestamp {
    Timestamp::from_system(SystemTime::now())
}

impl Inner {
    /// The writer, or EROFS on a read-only mount.
    pub(super) fn writer(&self) -> Result<&Writer, OpError> {
        self.writer
            .as_ref()
            .ok_or_else(|| OpError::new(Errno::EROFS, "the mount is read-only"))
    }

    /// Forgets the cached entry of mount-relative `path` (changed here).
    pub(super) fn forget(&self, path: &str) {
        lock(&self.names).forget(path);
    }

    /// `fut`, an etcd request about share path `sp`, bounded by the timeout.
    pub(super) async fn etcd<T>(
        &self,
        sp: &str,
        fut: impl std::future::Future<Output = Result<T, ClientError>>,
    ) -> Result<T, OpError> {
        tokio::time::timeout(self.opts.timeout, fut)
            .await
            .map_err(|_| {
                OpError::new(
                    Errno::EIO,
                    format!("{}/{sp}: etcd did not answer in time", self.share),
                )
            })?
            .map_err(|e| OpError::new(errno_of(&e), format!("{}/{sp}: {e}", self.share)))
    }

    /// The path of `name` in directory node `parent`, mount- and share-relative.
    pub(super) fn child(
        &self,
        parent: INodeNo,
        name: &std::ffi::OsStr,
    ) -> Result<(String, String), OpError> {
        let (dir, _) = self.path_of(parent)?;
        let path = join(&dir, utf8(name)?);
        let sp = self.share_path(&path);
        Ok((path, sp))
    }

    /// Where staged files' unfetched stripes come from.
    pub(super) fn source(&self) -> Result<Source<'_>, OpError> {
        Ok(Source {
            cluster: &self.writer()?.cluster,
            share: &self.share,
        })
    }

    /// A new staging file for handle `fh`: the file at `sp` as `entry` has it (of its
    /// size and mode, nothing fetched: every stripe unfetched, read from `entry`'s
    /// objects until a write needs it), or empty with `mode` when `entry` is `None`.
    async fn stage(
        &self,
        fh: u64,
        sp: &str,
        entry: Option<&Arc<Entry>>,
        mode: u32,
    ) -> Result<Staging, OpError> {
        let w = self.writer()?;
        let local = w.dir.join(format!("h{fh}"));
        let err = |e| local_err(&local, e);
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(&local)
            .map_err(err)?;
        let (base, presence) = match entry.filter(|e| e.size > 0) {
            Some(e) => {
                let base = Base::new(&self.share, sp, e.clone())?;
                let sb = base
                    .layout()
                    .map_or(w.config.stripe_bytes, |l| l.stripe_bytes);
                file.set_len(e.size).map_err(err)?;
                file.set_permissions(std::fs::Permissions::from_mode(e.mode & 0o7777))
                    .map_err(err)?;
                file.set_modified(e.mtime.to_system()).map_err(err)?;
                (Some(base), Presence::unfetched(e.size, sb))
            }
            None => {
                file.set_permissions(std::fs::Permissions::from_mode(mode & 0o7777))
                    .map_err(err)?;
                (None, Presence::local(0, w.config.stripe_bytes))
            }
        };
        Ok(Staging {
            local,
            file,
            base,
            presence,
        })
    }

    /// Registers the staged handle `fh`.
    fn keep_staged(
        &self,
        fh: u64,
        path: String,
        staging: Staging,
        dirty: bool,
        opener: Option<u32>,
    ) -> Arc<Staged> {
        let staged = Arc::new(staging.into_staged(path.clone(), dirty, opener));
        lock(&self.writes).insert(fh, staged.clone());
        lock(&self.staged).insert(path, staged.clone());
        staged
    }

    /// The handle open for writing `path` last, if any.
    pub(super) fn staged_at(&self, path: &str) -> Option<Arc<Staged>> {
        lock(&self.staged).get(path).cloned()
    }

    /// The staged handle `fh` (if open for writing), else the one open for writing
    /// node `ino`'s path last.
    pub(super) fn staged_for(
        &self,
        ino: INodeNo,
        fh: Option<fuser::FileHandle>,
    ) -> Option<Arc<Staged>> {
        fh.and_then(|fh| lock(&self.writes).get(&fh.0).cloned())
            .or_else(|| {
                let (path, kind) = self.path_of(ino).ok()?;
                (kind == EntryKind::File)
                    .then(|| self.staged_at(&path))
                    .flatten()
            })
    }

    /// Opens node `ino` for writing: returns the handle.
    pub(super) async fn open_write(
        &self,
        ino: INodeNo,
        flags: i32,
        opener: Option<u32>,
    ) -> Result<u64, OpError> {
        self.writer()?;
        let (path, _) = self.path_of(ino)?;
        // Close-to-open: the version written over is the one there now, not a cached
        // one (its stripes are the ones kept).
        let entry = self.node_entry_within(ino, Duration::ZERO).await?;
        match entry.kind {
            EntryKind::File => {}
            EntryKind::Dir => return Err(OpError::new(Errno::EISDIR, path)),
            EntryKind::Symlink => return Err(OpError::new(Errno::ELOOP, path)),
        }
        let truncate = flags & nix::libc::O_TRUNC != 0;
        let sp = self.share_path(&path);
        let fh = self.next_fh.fetch_add(1, Ordering::Relaxed);
        let staging = self
            .stage(fh, &sp, (!truncate).then_some(&entry), entry.mode)
            .await?;
        self.keep_staged(fh, path, staging, truncate, opener);
        Ok(fh)
    }

    /// Creates `name` in `parent` for writing (published at close): (node, handle,
    /// entry).
    pub(super) async fn create(
        &self,
        parent: INodeNo,
        name: &std::ffi::OsStr,
        mode: u32,
        flags: i32,
        opener: Option<u32>,
    ) -> Result<(u64, u64, Entry), OpError> {
        self.writer()?;
        let (path, sp) = self.child(parent, name)?;
        let existing = match self.entry(&path, Duration::ZERO).await {
            Ok(e) => Some(e),
            Err(e) if e.errno == Errno::ENOENT => None,
            Err(e) => return Err(e),
        };
        if let Some(e) = &existing {
            if flags & nix::libc::O_EXCL != 0 {
                return Err(OpError::new(Errno::EEXIST, sp));
            }
            if e.kind == EntryKind::Dir {
                return Err(OpError::new(Errno::EISDIR, sp));
            }
        }
        let base = existing
            .as_ref()
            .filter(|e| e.kind == EntryKind::File && flags & nix::libc::O_TRUNC == 0);
        let fh = self.next_fh.fetch_add(1, Ordering::Relaxed);
        let staging = self.stage(fh, &sp, base, mode).await?;
        self.forget(&path);
        let ino = lock(&self.names).id(&path, EntryKind::File);
        let staged = self.keep_staged(fh, path, staging, true, opener);
        Ok((ino, fh, staged.entry()?))
    }

    /// Publishes `staged` if it changed since it was last published: the file goes to
    /// the nodes (its changed stripes), then its entry to etcd. EIO if anything fails
    /// (nothing published).
    pub(super) async fn publish(&self, staged: &Staged) -> Result<(), OpError> {
        let w = self.writer()?;
        let _one = staged.hold().await;
        if !staged.take_dirty() {
            return Ok(());
        }
        let path = staged.path();
        let sp = self.share_path(&path);
        let mut unfetched = staged.unfetched();
        let put = async {
            w.cluster.refresh_nodes().await?;
            // Only the stripes whose bytes changed are sent: the others, and those never
            // fetched, keep the objects of the version there now (copy-on-write per
            // stripe), where it names the ones of the version opened.
            let base = staged
                .base()
                .filter(|_| unfetched.iter().any(|u| *u))
                .and_then(|b| Some((b.layout()?, b.entry.size)));
            let unfetched = base.map(|(base, base_size)| Unfetched {
                base,
                base_size,
                stripes: &mut unfetched,
            });
            w.cluster
                .put_staged(
                    &staged.local,
                    (&self.share, &sp),
                    w.config,
                    no_progress(),
                    unfetched,
                )
                .await
        };
        let got = put.await;
        staged.fetched_at_publication(&unfetched);
        self.forget(&path);
        match got {
            Ok(put) => {
                tracing::debug!(
                    file = %format!("{}/{sp}", self.share),
                    stripes_sent = put.stripes_sent,
                    stripes_reused = put.stripes_reused,
                    "published"
                );
                Ok(())
            }
            Err(e) => {
                staged.set_dirty();
                Err(OpError::new(
                    Errno::EIO,
                    format!("{}/{sp}: not written: {e}", self.share),
                ))
            }
        }
    }

    /// The last close of handle `fh`: publishes what is left, then drops the
    /// staging file.
    pub(super) async fn release_write(&self, staged: Arc<Staged>) {
        if let Err(e) = self.publish(&staged).await {
            tracing::warn!("release: {}", e.message);
        }
        {
            let path = staged.path();
            let mut map = lock(&self.staged);
            if map.get(&path).is_some_and(|s| Arc::ptr_eq(s, &staged)) {
                map.remove(&path);
            }
        }
        staged.release();
        let _ = std::fs::remove_file(&staged.local);
    }

    /// setattr: on a staged handle with changes not yet published (`fh`, or the
    /// newest one of the node's path) the staging file; else a truncation publishes a
    /// new version and mode and mtime change the entry by compare-and-swap (and the
    /// staging file of a clean handle, so its next publication keeps them). Returns
    /// the entry now.
    pub(super) async fn set_attr(
        &self,
        ino: INodeNo,
        (staged, on_handle): (Option<Arc<Staged>>, bool),
        mode: Option<u32>,
        size: Option<u64>,
        mtime: Option<TimeOrNow>,
    ) -> Result<Entry, OpError> {
        self.writer()?;
        let src = self.source()?;
        // ftruncate of a handle is published at its close, even a clean one's.
        let clean = match staged {
            Some(s) if s.is_dirty() || (on_handle && size.is_some()) => {
                s.set(src, (mode, size, mtime), true).await?;
                return s.entry();
            }
            other => other,
        };
        let (path, _) = self.path_of(ino)?;
        let sp = self.share_path(&path);
        if let Some(size) = size {
            let entry = self.node_entry_within(ino, Duration::ZERO).await?;
            if entry.kind != EntryKind::File {
                return Err(OpError::new(Errno::EISDIR, sp));
            }
            if let Some(s) = &clean {
                // Its stripe the new end cuts, fetched while the version it was opened
                // at is current (the publication below removes that object).
                s.prefetch_resize(src, size).await?;
            }
            // Staged as an open would, then truncated: only the stripe the new end
            // cuts is fetched; the stripes before it keep their objects.
            let fh = self.next_fh.fetch_add(1, Ordering::Relaxed);
            let base = (size > 0).then_some(&entry);
            let staged =
                self.stage(fh, &sp, base, entry.mode)
                    .await?
                    .into_staged(path.clone(), false, None);
            let got = match staged.set(src, (mode, Some(size), mtime), true).await {
                Ok(()) => self.publish(&staged).await,
                Err(e) => Err(e),
            };
            staged.release();
            let _ = std::fs::remove_file(&staged.local);
            got?;
            if let Some(s) = &clean {
                s.set(src, (mode, Some(size), mtime), false).await?;
            }
            return Ok((*self.node_entry(ino).await?).clone());
        }
        if mode.is_none() && mtime.is_none() {
            return Ok((*self.node_entry(ino).await?).clone());
        }
        if sp.is_empty() {
            // The share's root is implicit: nothing to change.
            return Ok((*self.node_entry(ino).await?).clone());
        }
        let meta = self.nodes.meta();
        for _ in 0..TRIES {
            let Some(v) = self.etcd(&sp, meta.entry(&self.share, &sp)).await? else {
                self.forget(&path);
                return Err(OpError::new(Errno::ENOENT, sp));
            };
            let mut entry = v.entry;
            if let Some(mode) = mode {
                if entry.kind != EntryKind::Symlink {
                    entry.mode = mode & 0o7777;
                }
            }
            if let Some(t) = mtime {
                entry.mtime = Timestamp::from_system(system_time(t));
            }
            let done = self
                .etcd(&sp, meta.commit(&self.share, &sp, &entry, v.revision))
                .await?;
            if let Commit::Done(_) = done {
                self.forget(&path);
                if let Some(s) = &clean {
                    s.set(src, (mode, None, mtime), false).await?;
                }
                return Ok(entry);
            }
        }
        Err(OpError::new(
            Errno::EIO,
            format!("{sp}: changed by others {TRIES} times in a row"),
        ))
    }

    /// Puts the new entry `entry` at `name` of `parent` (mkdir, symlink): EEXIST if
    /// the name is taken. Returns the node id.
    pub(super) async fn make(
        &self,
        parent: INodeNo,
        name: &std::ffi::OsStr,
        entry: &Entry,
    ) -> Result<u64, OpError> {
        self.writer()?;
        let (path, sp) = self.child(parent, name)?;
        let meta = self.nodes.meta();
        let done = self
            .etcd(&sp, meta.commit(&self.share, &sp, entry, 0))
            .await?;
        self.forget(&path);
        if done == Commit::Conflict {
            let (parent_path, _) = self.path_of(parent)?;
            let psp = self.share_path(&parent_path);
            let parent_there = self.etcd(&psp, meta.entry(&self.share, &psp)).await?;
            return Err(match parent_there {
                Some(_) => OpError::new(Errno::EEXIST, sp),
                None => OpError::new(Errno::ENOENT, format!("{psp}: no such directory")),
            });
        }
        Ok(lock(&self.names).id(&path, entry.kind))
    }

    /// A new directory's or symlink's entry.
    pub(super) fn new_entry(kind: EntryKind, mode: u32, target: Option<String>) -> Entry {
        Entry {
            kind,
            mode: mode & 0o7777,
            mtime: now(),
            size: 0,
            target,
            layout: None,
        }
    }

    /// unlink (`dir` false) or rmdir (`dir` true) of `name` in `parent`; an
    /// unlinked file's objects are removed from the nodes (unless a backup shares
    /// them).
    pub(super) async fn remove(
        &self,
        parent: INodeNo,
        name: &std::ffi::OsStr,
        dir: bool,
    ) -> Result<(), OpError> {
        let w = self.writer()?;
        let (path, sp) = self.child(parent, name)?;
        let meta = self.nodes.meta();
        for _ in 0..TRIES {
            let Some(v) = self.etcd(&sp, meta.entry(&self.share, &sp)).await? else {
                self.forget(&path);
                return Err(OpError::new(Errno::ENOENT, sp));
            };
            match (dir, v.entry.kind == EntryKind::Dir) {
                (true, false) => return Err(OpError::new(Errno::ENOTDIR, sp)),
                (false, true) => return Err(OpError::new(Errno::EISDIR, sp)),
                (true, true) => {
                    let below = self.etcd(&sp, meta.below(&self.share, &sp)).await?;
                    if !below.is_empty() {
                        return Err(OpError::new(Errno::ENOTEMPTY, sp));
                    }
                }
                (false, false) => {}
            }
            let done = self
                .etcd(&sp, meta.remove(&self.share, &sp, v.revision))
                .await?;
            if let Commit::Done(_) = done {
                self.forget(&path);
                if let Some(layout) = &v.entry.layout {
                    w.cluster.remove_unshared(&self.share, layout).await;
                }
                return Ok(());
            }
        }
        Err(OpError::new(
            Errno::EIO,
            format!("{sp}: changed by others {TRIES} times in a row"),
        ))
    }
}
