//! Writes through a cluster mount: close-to-open, whole files, as the single-server
//! mount's staged files.
//!
//! ```text
//!  create / open for writing ──> a staging file of this handle in the mount's private
//!        directory (an existing file opened without O_TRUNC is fetched into it first)
//!  write, read, fstat, truncate on the handle ──> the staging file
//!  flush (close) / fsync of a changed handle ──> Cluster::put_file_reusing: the
//!        stripes whose bytes changed to their nodes (the others name the objects of
//!        the version there now), then the entry by compare-and-swap: the new version
//!        appears whole, at once; a failure answers EIO and publishes nothing
//!  mkdir, rmdir, unlink, symlink, rename, chmod, utimens ──> one etcd transaction each,
//!        comparing the revision read (rename: both names' revisions)
//! ```
//!
//! Invariants: a file written through the mount is visible to others only once a
//! close or fsync published it, whole; every path the mount changes is dropped from
//! its entry cache; a directory is renamed with everything below it in one transaction
//! ([`super::rename`]).

use std::fs::{File, OpenOptions};
use std::os::unix::fs::{FileExt, MetadataExt, PermissionsExt};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use ferry_client::transfer::ProgressFn;
use ferry_client::ClientError;
use ferry_cluster::meta::Commit;
use ferry_cluster::model::{Entry, EntryKind, ShareConfig};
use ferry_cluster::Cluster;
use ferry_common::msg::Timestamp;
use fuser::{Errno, INodeNo, TimeOrNow};

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

/// One handle open for writing: its staging file.
pub struct Staged {
    /// Mount-relative path: where it is published. A rename of the file through this
    /// mount moves it ([`Staged::move_to`]), so it is never published under a name
    /// it no longer has.
    path: Mutex<String>,
    /// The staging file.
    pub local: PathBuf,
    file: File,
    /// Changed since it was last published.
    dirty: AtomicBool,
    /// The process that opened it: its close publishes; another process's (a child
    /// closing the inherited descriptor at exec) does not.
    opener: Option<u32>,
    /// One publication at a time.
    publishing: tokio::sync::Mutex<()>,
}

impl Staged {
    /// Mount-relative path it publishes to.
    pub fn path(&self) -> String {
        lock(&self.path).clone()
    }

    /// The file was renamed to mount path `to`.
    pub fn move_to(&self, to: &str) {
        *lock(&self.path) = to.to_owned();
    }

    /// The entry this handle would publish now (no layout yet).
    pub fn entry(&self) -> Result<Entry, OpError> {
        let md = self
            .file
            .metadata()
            .map_err(|e| local_err(&self.local, e))?;
        Ok(Entry {
            kind: EntryKind::File,
            mode: md.mode() & 0o7777,
            mtime: ferry_common::attr::attr_of(&md, None).mtime,
            size: md.len(),
            target: None,
            layout: None,
        })
    }

    /// Writes `data` at `offset` of the staging file.
    pub fn write(&self, offset: u64, data: &[u8]) -> Result<(), OpError> {
        self.dirty.store(true, Ordering::SeqCst);
        self.file
            .write_all_at(data, offset)
            .map_err(|e| local_err(&self.local, e))
    }

    /// Reads up to `len` bytes at `offset` of the staging file.
    pub fn read(&self, offset: u64, len: u32) -> Result<Vec<u8>, OpError> {
        let mut buf = vec![0; len as usize];
        let mut got = 0;
        while got < buf.len() {
            match self.file.read_at(&mut buf[got..], offset + got as u64) {
                Ok(0) => break,
                Ok(n) => got += n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(local_err(&self.local, e)),
            }
        }
        buf.truncate(got);
        Ok(buf)
    }

    /// True if a close by process `tgid` publishes this handle: the opener's (or
    /// anyone's when the opener is unknown).
    pub fn closed_by_opener(&self, tgid: Option<u32>) -> bool {
        self.opener.is_none() || self.opener == tgid
    }

    /// Changed since it was last published.
    pub fn is_dirty(&self) -> bool {
        self.dirty.load(Ordering::SeqCst)
    }

    /// Changes size, mode and mtime of the staging file (published at close if
    /// `publish`; else the change was made elsewhere and is only kept in step here).
    fn set(
        &self,
        mode: Option<u32>,
        size: Option<u64>,
        mtime: Option<TimeOrNow>,
        publish: bool,
    ) -> Result<(), OpError> {
        let err = |e| local_err(&self.local, e);
        if publish {
            self.dirty.store(true, Ordering::SeqCst);
        }
        if let Some(size) = size {
            self.file.set_len(size).map_err(err)?;
        }
        if let Some(mode) = mode {
            self.file
                .set_permissions(std::fs::Permissions::from_mode(mode & 0o7777))
                .map_err(err)?;
        }
        if let Some(t) = mtime {
            self.file.set_modified(system_time(t)).map_err(err)?;
        } else if size.is_some() {
            self.file.set_modified(SystemTime::now()).map_err(err)?;
        }
        Ok(())
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

    /// A new staging file for handle `fh`: the file at `sp` as `entry` has it
    /// (fetched from the nodes), or empty with `mode` when `entry` is `None`.
    async fn stage(
        &self,
        fh: u64,
        sp: &str,
        entry: Option<&Entry>,
        mode: u32,
    ) -> Result<(PathBuf, File), OpError> {
        let w = self.writer()?;
        let local = w.dir.join(format!("h{fh}"));
        match entry.filter(|e| e.size > 0) {
            Some(e) => {
                w.cluster
                    .refresh_nodes()
                    .await
                    .map_err(|e| OpError::new(Errno::EIO, format!("storage nodes: {e}")))?;
                w.cluster
                    .get_file(&self.share, sp, e, &local, no_progress())
                    .await
                    .map_err(|e| OpError::new(Errno::EIO, format!("{}/{sp}: {e}", self.share)))?;
            }
            None => {
                File::create(&local).map_err(|e| local_err(&local, e))?;
                std::fs::set_permissions(&local, std::fs::Permissions::from_mode(mode & 0o7777))
                    .map_err(|e| local_err(&local, e))?;
            }
        }
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .open(&local)
            .map_err(|e| local_err(&local, e))?;
        Ok((local, file))
    }

    /// Registers the staged handle `fh`.
    fn keep_staged(
        &self,
        fh: u64,
        path: String,
        (local, file): (PathBuf, File),
        dirty: bool,
        opener: Option<u32>,
    ) {
        let staged = Arc::new(Staged {
            path: Mutex::new(path.clone()),
            local,
            file,
            dirty: AtomicBool::new(dirty),
            opener,
            publishing: tokio::sync::Mutex::new(()),
        });
        lock(&self.writes).insert(fh, staged.clone());
        lock(&self.staged).insert(path, staged);
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
        let entry = self.node_entry(ino).await?;
        match entry.kind {
            EntryKind::File => {}
            EntryKind::Dir => return Err(OpError::new(Errno::EISDIR, path)),
            EntryKind::Symlink => return Err(OpError::new(Errno::ELOOP, path)),
        }
        let truncate = flags & nix::libc::O_TRUNC != 0;
        let sp = self.share_path(&path);
        let fh = self.next_fh.fetch_add(1, Ordering::Relaxed);
        let staged = self
            .stage(fh, &sp, (!truncate).then_some(&*entry), entry.mode)
            .await?;
        self.keep_staged(fh, path, staged, truncate, opener);
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
        let fetch = existing
            .as_deref()
            .filter(|e| e.kind == EntryKind::File && flags & nix::libc::O_TRUNC == 0);
        let fh = self.next_fh.fetch_add(1, Ordering::Relaxed);
        let staged = self.stage(fh, &sp, fetch, mode).await?;
        self.forget(&path);
        let ino = lock(&self.names).id(&path, EntryKind::File);
        self.keep_staged(fh, path, staged, true, opener);
        let staged = lock(&self.writes).get(&fh).cloned().expect("just kept");
        Ok((ino, fh, staged.entry()?))
    }

    /// Publishes `staged` if it changed since it was last published: the file goes to
    /// the nodes, then its entry to etcd. EIO if anything fails (nothing published).
    pub(super) async fn publish(&self, staged: &Staged) -> Result<(), OpError> {
        let w = self.writer()?;
        let _one = staged.publishing.lock().await;
        if !staged.dirty.swap(false, Ordering::SeqCst) {
            return Ok(());
        }
        let path = staged.path();
        let sp = self.share_path(&path);
        let put = async {
            w.cluster.refresh_nodes().await?;
            // Only the stripes whose bytes changed are sent: the others keep the
            // objects of the version there now (copy-on-write per stripe).
            w.cluster
                .put_file_reusing(&staged.local, (&self.share, &sp), w.config, no_progress())
                .await
        };
        let got = put.await;
        self.forget(&path);
        match got {
            Ok(_) => Ok(()),
            Err(e) => {
                staged.dirty.store(true, Ordering::SeqCst);
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
        // ftruncate of a handle is published at its close, even a clean one's.
        let clean = match staged {
            Some(s) if s.is_dirty() || (on_handle && size.is_some()) => {
                s.set(mode, size, mtime, true)?;
                return s.entry();
            }
            other => other,
        };
        let (path, _) = self.path_of(ino)?;
        let sp = self.share_path(&path);
        if let Some(size) = size {
            let entry = self.node_entry(ino).await?;
            if entry.kind != EntryKind::File {
                return Err(OpError::new(Errno::EISDIR, sp));
            }
            let fh = self.next_fh.fetch_add(1, Ordering::Relaxed);
            let fetch = (size > 0).then_some(&*entry);
            let (local, file) = self.stage(fh, &sp, fetch, entry.mode).await?;
            let staged = Staged {
                path: Mutex::new(path.clone()),
                local,
                file,
                dirty: AtomicBool::new(false),
                opener: None,
                publishing: tokio::sync::Mutex::new(()),
            };
            let got = match staged.set(mode, Some(size), mtime, true) {
                Ok(()) => self.publish(&staged).await,
                Err(e) => Err(e),
            };
            let _ = std::fs::remove_file(&staged.local);
            got?;
            if let Some(s) = &clean {
                s.set(mode, Some(size), mtime, false)?;
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
                    s.set(mode, None, mtime, false)?;
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
