//! The FUSE mount of a cluster share (`ferry-mount cluster://ETCD/SHARE`), read-write
//! unless mounted `-o ro`.
//!
//! ```text
//!  lookup/getattr/readdir/readlink ──> etcd: the entry at /ferry/ns/SHARE/PATH (and the
//!                                      keys below a directory), cached attr_timeout
//!  open ──> the entry's layout, fixed for this descriptor
//!  read ──> stripe(s) covering the range ──> first live replica not failed lately:
//!           MapOpen of the object, manifest by RDMA READ, its id == the layout's?
//!           ──> one-sided READs, every chunk checked ──> reply
//!           (a replica that fails or does not verify: the next one, no error)
//!  create, open for writing, write, mkdir, unlink, rename, setattr, ... ──> [`write`]
//!           (close-to-open, whole files; EROFS on a read-only mount), each descriptor
//!           open for writing a [`staged`] file, its stripes fetched as writes need them
//! ```
//!
//! - [`names`]: node ids (one per path and kind, kept for the mount's life) and the
//!   entry caches.
//! - [`stripes`]: the storage nodes (one [`crate::remote::Remote`] and
//!   [`crate::reader::Reader`] each: the single-server mount's verified one-sided
//!   read path) and open files, read stripe by stripe from any replica that verifies.
//! - [`write`]: staged writes published whole at close, and the namespace changes;
//!   [`staged`]: one descriptor's staging file, which stripes it holds and which are
//!   still only the version opened's.
//! - [`locks`]: `flock` and `fcntl` locks, held in etcd under the mount's lease.
//!
//! Invariants: a read-only mount never changes the cluster (every modifying operation
//! answers EROFS, and the kernel mount is `ro`); a file's bytes reach a reader only after their
//! chunk matched a hash list whose manifest id is the one the layout records; an open
//! descriptor reads the layout it was opened with.

pub mod locks;
pub mod names;
mod rename;
pub mod staged;
pub mod stripes;
pub mod write;

use std::collections::HashMap;
use std::ffi::OsStr;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use ferry_cluster::model::{Entry, EntryKind};
use fuser::{
    Errno, FileAttr, FileHandle, FileType, FopenFlags, Generation, INodeNo, KernelConfig,
    OpenFlags, ReplyAttr, ReplyData, ReplyDirectory, ReplyEmpty, ReplyEntry, ReplyOpen,
    ReplyStatfs, Request,
};
use tokio::runtime::Handle;

use crate::bufs::BufPool;
use crate::fs::tgid_of;
use crate::locks::Locks;
use crate::nodes::join;
use crate::options::MountOptions;
use crate::remote::{errno_of, lock, OpError};
use ferry_cluster::locks::ClusterLocks;
use names::{Names, ROOT};
use staged::Staged;
use stripes::{ClusterFile, Nodes, ReadOut};
use write::Writer;

/// Idle reply buffers kept for reads that span stripes.
const REPLY_BUFFERS_KEPT: usize = 16;

/// Block size reported by statfs.
const BLOCK: u64 = 4096;

/// A mounted cluster share (or a directory in one).
pub struct ClusterFs {
    inner: Arc<Inner>,
    rt: Handle,
}

/// One listed child: name, node id, kind.
type Listed = (String, u64, EntryKind);

struct Inner {
    nodes: Arc<Nodes>,
    share: String,
    /// Share-relative directory mounted as the root (`""`: the share's root).
    root: String,
    opts: MountOptions,
    uid: u32,
    gid: u32,
    names: Mutex<Names>,
    files: Mutex<HashMap<u64, Arc<ClusterFile>>>,
    dirs: Mutex<HashMap<u64, Arc<Vec<Listed>>>>,
    /// The layout each node was last opened at: the kernel keeps its page cache only
    /// when the next open finds the same one.
    opened: Mutex<HashMap<u64, String>>,
    next_fh: AtomicU64,
    bufs: BufPool,
    /// `None`: a read-only mount.
    writer: Option<Writer>,
    /// Handles open for writing, by handle.
    writes: Mutex<HashMap<u64, Arc<Staged>>>,
    /// The handle open for writing each path last (its attributes are the path's).
    staged: Mutex<HashMap<String, Arc<Staged>>>,
    /// What this mount holds of the share's locks ([`locks`]).
    locks: Locks,
    /// The share's locks in etcd, under this mount's lease.
    held: Arc<ClusterLocks>,
}

impl ClusterFs {
    /// A filesystem for `share/root` of the cluster whose etcd and nodes `nodes`
    /// reaches, run on `rt`; writable through `writer` if given.
    pub fn new(
        rt: Handle,
        nodes: Arc<Nodes>,
        share: String,
        root: String,
        opts: MountOptions,
        writer: Option<Writer>,
    ) -> ClusterFs {
        let held = locks::cluster_locks(nodes.meta().clone(), &share);
        ClusterFs {
            inner: Arc::new(Inner {
                nodes,
                share,
                root,
                opts,
                uid: nix::unistd::getuid().as_raw(),
                gid: nix::unistd::getgid().as_raw(),
                names: Mutex::new(Names::new()),
                files: Mutex::new(HashMap::new()),
                dirs: Mutex::new(HashMap::new()),
                opened: Mutex::new(HashMap::new()),
                next_fh: AtomicU64::new(1),
                bufs: BufPool::new(REPLY_BUFFERS_KEPT),
                writer,
                writes: Mutex::new(HashMap::new()),
                staged: Mutex::new(HashMap::new()),
                locks: Locks::new(),
                held,
            }),
            rt,
        }
    }

    /// Runs `f` on the runtime with the shared state.
    fn spawn<F, Fut>(&self, f: F)
    where
        F: FnOnce(Arc<Inner>) -> Fut,
        Fut: std::future::Future<Output = ()> + Send + 'static,
    {
        self.rt.spawn(f(self.inner.clone()));
    }
}

/// The errno for a change asked of this read-only mount.
fn read_only() -> Errno {
    Errno::EROFS
}

/// Logs a failed operation at a level that fits its errno, and returns the errno.
fn fail(op: &str, e: OpError) -> Errno {
    if e.errno == Errno::ENOENT {
        tracing::debug!("{op}: {}", e.message);
    } else {
        tracing::warn!("{op}: {}", e.message);
    }
    e.errno
}

fn file_type(kind: EntryKind) -> FileType {
    match kind {
        EntryKind::File => FileType::RegularFile,
        EntryKind::Dir => FileType::Directory,
        EntryKind::Symlink => FileType::Symlink,
    }
}

impl Inner {
    /// The share-relative path of mount-relative `path`.
    fn share_path(&self, path: &str) -> String {
        match (self.root.is_empty(), path.is_empty()) {
            (true, _) => path.to_owned(),
            (false, true) => self.root.clone(),
            (false, false) => format!("{}/{path}", self.root),
        }
    }

    fn path_of(&self, ino: INodeNo) -> Result<(String, EntryKind), OpError> {
        lock(&self.names)
            .path(ino.0)
            .ok_or_else(|| OpError::new(Errno::ESTALE, format!("unknown inode {}", ino.0)))
    }

    fn file_attr(&self, ino: u64, e: &Entry) -> FileAttr {
        let mtime = e.mtime.to_system();
        let size = match e.kind {
            EntryKind::File => e.size,
            EntryKind::Symlink => e.target.as_ref().map_or(0, |t| t.len() as u64),
            EntryKind::Dir => 0,
        };
        FileAttr {
            ino: INodeNo(ino),
            size,
            blocks: size.div_ceil(512),
            atime: mtime,
            mtime,
            ctime: mtime,
            crtime: mtime,
            kind: file_type(e.kind),
            perm: (e.mode & 0o7777) as u16,
            nlink: if e.kind == EntryKind::Dir { 2 } else { 1 },
            uid: self.uid,
            gid: self.gid,
            rdev: 0,
            blksize: BLOCK as u32,
            flags: 0,
        }
    }

    /// The entry at mount-relative `path`: cached within `ttl`, else from etcd. A
    /// missing name is remembered for the negative TTL.
    async fn entry(&self, path: &str, ttl: Duration) -> Result<Arc<Entry>, OpError> {
        let now = Instant::now();
        {
            let names = lock(&self.names);
            if let Some(e) = names.entry(path, now, ttl) {
                return Ok(e);
            }
            if names.is_missing(path, now, self.opts.negative_ttl) {
                return Err(OpError::new(
                    Errno::ENOENT,
                    format!("{path}: not found (cached)"),
                ));
            }
        }
        let sp = self.share_path(path);
        let got = self
            .etcd(&sp, self.nodes.meta().entry(&self.share, &sp))
            .await?;
        let now = Instant::now();
        match got {
            Some(v) => {
                let e = Arc::new(v.entry);
                lock(&self.names).store(path, e.clone(), now, self.opts.attr_ttl);
                Ok(e)
            }
            None => {
                if !self.opts.negative_ttl.is_zero() {
                    lock(&self.names).store_missing(path, now, self.opts.negative_ttl);
                }
                Err(OpError::new(
                    Errno::ENOENT,
                    format!("{}/{sp}: not found", self.share),
                ))
            }
        }
    }

    async fn lookup(&self, parent: INodeNo, name: &OsStr) -> Result<(u64, Arc<Entry>), OpError> {
        let name = name
            .to_str()
            .ok_or_else(|| OpError::new(Errno::ENOENT, "name is not UTF-8"))?;
        let (dir, _) = self.path_of(parent)?;
        let path = join(&dir, name);
        if let Some(staged) = self.staged_at(&path) {
            // Open for writing here: the handle's size and times (a new file is
            // nowhere else yet).
            let ino = lock(&self.names).id(&path, EntryKind::File);
            return Ok((ino, Arc::new(staged.entry()?)));
        }
        let ttl = self.opts.entry_ttl.min(self.opts.attr_ttl);
        let entry = self.entry(&path, ttl).await?;
        let ino = lock(&self.names).id(&path, entry.kind);
        Ok((ino, entry))
    }

    /// The entry of node `ino` now; ESTALE if its name holds another kind by now.
    async fn node_entry(&self, ino: INodeNo) -> Result<Arc<Entry>, OpError> {
        self.node_entry_within(ino, self.opts.attr_ttl).await
    }

    /// [`Inner::node_entry`], as cached within `ttl` at most.
    async fn node_entry_within(&self, ino: INodeNo, ttl: Duration) -> Result<Arc<Entry>, OpError> {
        let (path, kind) = self.path_of(ino)?;
        let entry = self.entry(&path, ttl).await?;
        if entry.kind != kind {
            return Err(OpError::new(
                Errno::ESTALE,
                format!("{path}: now a {:?}, not a {kind:?}", entry.kind),
            ));
        }
        Ok(entry)
    }

    async fn open(&self, ino: INodeNo) -> Result<(u64, bool), OpError> {
        let (path, _) = self.path_of(ino)?;
        let entry = self.node_entry(ino).await?;
        match entry.kind {
            EntryKind::File => {}
            EntryKind::Dir => return Err(OpError::new(Errno::EISDIR, path)),
            EntryKind::Symlink => {
                return Err(OpError::new(Errno::ELOOP, format!("{path}: a symlink")))
            }
        }
        let file = ClusterFile::new(&self.share, &self.share_path(&path), entry)?;
        let keep = lock(&self.opened).insert(ino.0, file.layout_id().to_owned())
            == Some(file.layout_id().to_owned());
        let fh = self.next_fh.fetch_add(1, Ordering::Relaxed);
        lock(&self.files).insert(fh, Arc::new(file));
        Ok((fh, keep))
    }

    /// The children of directory node `ino`, their entries cached on the way.
    async fn list(&self, ino: INodeNo) -> Result<u64, OpError> {
        let (path, _) = self.path_of(ino)?;
        let entry = self.node_entry(ino).await?;
        if entry.kind != EntryKind::Dir {
            return Err(OpError::new(Errno::ENOTDIR, path));
        }
        let sp = self.share_path(&path);
        let below =
            tokio::time::timeout(self.opts.timeout, self.nodes.meta().below(&self.share, &sp))
                .await
                .map_err(|_| OpError::new(Errno::EIO, format!("list {sp}: etcd did not answer")))?
                .map_err(|e| {
                    OpError::new(errno_of(&e), format!("list {}/{sp}: {e}", self.share))
                })?;
        let prefix = if sp.is_empty() {
            String::new()
        } else {
            format!("{sp}/")
        };
        let now = Instant::now();
        let mut listed = Vec::new();
        {
            let mut names = lock(&self.names);
            for (key, v) in below {
                let Some(name) = key.strip_prefix(&prefix) else {
                    continue;
                };
                if name.is_empty() || name.contains('/') {
                    continue;
                }
                let child = join(&path, name);
                let kind = v.entry.kind;
                names.store(&child, Arc::new(v.entry), now, self.opts.attr_ttl);
                listed.push((name.to_owned(), names.id(&child, kind), kind));
            }
        }
        let fh = self.next_fh.fetch_add(1, Ordering::Relaxed);
        lock(&self.dirs).insert(fh, Arc::new(listed));
        Ok(fh)
    }
}

impl Inner {
    /// Replies with `got` and hands its buffer back where it came from.
    fn answer_read(&self, reply: ReplyData, got: Result<ReadOut, OpError>) {
        match got {
            Ok(out) => {
                reply.data(&out.data);
                match out.home {
                    Some(reader) => reader.recycle(out.data),
                    None => self.bufs.give(out.data),
                }
            }
            Err(e) => reply.error(fail("read", e)),
        }
    }
}

impl fuser::Filesystem for ClusterFs {
    fn init(&mut self, _req: &Request, config: &mut KernelConfig) -> std::io::Result<()> {
        // Large kernel readahead requests; each stripe's reader reads ahead on top.
        let _ = config.set_max_readahead(1 << 20);
        if self.inner.writer.is_some() {
            // Writes of up to 1 MiB per request; O_TRUNC reaches `open`, so a
            // truncating open stages an empty file instead of fetching the old one.
            let _ = config.set_max_write(1 << 20);
            if let Err(missing) = config.add_capabilities(fuser::InitFlags::FUSE_ATOMIC_O_TRUNC) {
                tracing::warn!("the kernel lacks {missing:?}: O_TRUNC fetches first");
            }
        }
        let flags = fuser::InitFlags::FUSE_POSIX_LOCKS | fuser::InitFlags::FUSE_FLOCK_LOCKS;
        if let Err(missing) = config.add_capabilities(flags) {
            tracing::warn!("the kernel lacks {missing:?}: those locks stay local to this mount");
        }
        Ok(())
    }

    fn destroy(&mut self) {
        if let Some(w) = &self.inner.writer {
            w.remove_staging();
        }
        // Every lock of this mount goes now, not at the lease's expiry.
        let timeout = self.inner.opts.timeout;
        let held = &self.inner.held;
        let _ = self
            .rt
            .block_on(async { tokio::time::timeout(timeout, held.close()).await });
    }

    fn lookup(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEntry) {
        let name = name.to_owned();
        self.spawn(|fs| async move {
            match fs.lookup(parent, &name).await {
                Ok((ino, entry)) => reply.entry_with_ttls(
                    &fs.opts.attr_ttl,
                    &fs.opts.entry_ttl,
                    &fs.file_attr(ino, &entry),
                    Generation(0),
                ),
                Err(e) => reply.error(fail("lookup", e)),
            }
        });
    }

    fn getattr(&self, _req: &Request, ino: INodeNo, fh: Option<FileHandle>, reply: ReplyAttr) {
        // fstat of an open descriptor: the version it reads.
        let open = fh.and_then(|fh| lock(&self.inner.files).get(&fh.0).cloned());
        if let Some(file) = open {
            return reply.attr(
                &self.inner.opts.attr_ttl,
                &self.inner.file_attr(ino.0, file.entry()),
            );
        }
        let staged = self.inner.staged_for(ino, fh);
        if let Some(staged) = staged {
            return match staged.entry() {
                Ok(e) => reply.attr(&Duration::ZERO, &self.inner.file_attr(ino.0, &e)),
                Err(e) => reply.error(fail("getattr", e)),
            };
        }
        self.spawn(|fs| async move {
            match fs.node_entry(ino).await {
                Ok(e) => reply.attr(&fs.opts.attr_ttl, &fs.file_attr(ino.0, &e)),
                Err(e) => reply.error(fail("getattr", e)),
            }
        });
    }

    fn readlink(&self, _req: &Request, ino: INodeNo, reply: ReplyData) {
        self.spawn(|fs| async move {
            match fs.node_entry(ino).await {
                Ok(e) => match (&e.kind, &e.target) {
                    (EntryKind::Symlink, Some(t)) => reply.data(t.as_bytes()),
                    _ => reply.error(Errno::EINVAL),
                },
                Err(e) => reply.error(fail("readlink", e)),
            }
        });
    }

    fn open(&self, req: &Request, ino: INodeNo, flags: OpenFlags, reply: ReplyOpen) {
        let acc = flags.0 & nix::libc::O_ACCMODE;
        if acc != nix::libc::O_RDONLY || flags.0 & nix::libc::O_TRUNC != 0 {
            if self.inner.writer.is_none() {
                return reply.error(read_only());
            }
            let opener = tgid_of(req.pid());
            return self.spawn(|fs| async move {
                match fs.open_write(ino, flags.0, opener).await {
                    Ok(fh) => reply.opened(FileHandle(fh), FopenFlags::empty()),
                    Err(e) => reply.error(fail("open", e)),
                }
            });
        }
        self.spawn(|fs| async move {
            match fs.open(ino).await {
                Ok((fh, keep)) => {
                    let flags = if keep {
                        FopenFlags::FOPEN_KEEP_CACHE
                    } else {
                        FopenFlags::empty()
                    };
                    reply.opened(FileHandle(fh), flags)
                }
                Err(e) => reply.error(fail("open", e)),
            }
        });
    }

    fn read(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        size: u32,
        _flags: OpenFlags,
        _lock_owner: Option<fuser::LockOwner>,
        reply: ReplyData,
    ) {
        if let Err(e) = self.inner.lock_lost(fh.0) {
            return reply.error(fail("read", e));
        }
        let staged = lock(&self.inner.writes).get(&fh.0).cloned();
        if let Some(staged) = staged {
            // Local stripes on this thread; unfetched ones from the version opened.
            if let Some(got) = staged.try_read(offset, size) {
                return match got {
                    Ok(data) => reply.data(&data),
                    Err(e) => reply.error(fail("read", e)),
                };
            }
            return self.spawn(|fs| async move {
                match staged.read((&fs.nodes, &fs.bufs), offset, size).await {
                    Ok(data) => reply.data(&data),
                    Err(e) => reply.error(fail("read", e)),
                }
            });
        }
        let Some(file) = lock(&self.inner.files).get(&fh.0).cloned() else {
            return reply.error(Errno::EBADF);
        };
        // Cached chunks are answered on this thread: no hand-off to the runtime.
        let cached = {
            let _runtime = self.rt.enter();
            file.read_cached(&self.inner.bufs, offset, size)
        };
        if let Some(out) = cached {
            return self.inner.answer_read(reply, Ok(out));
        }
        self.spawn(|fs| async move {
            let got = file.read(&fs.nodes, &fs.bufs, offset, size).await;
            fs.answer_read(reply, got);
        });
    }

    fn release(
        &self,
        _req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        _flags: OpenFlags,
        lock_owner: Option<fuser::LockOwner>,
        _flush: bool,
        reply: ReplyEmpty,
    ) {
        self.inner.locks.forget_fh(fh.0);
        if let Some(owner) = lock_owner {
            // The last close of a descriptor that `flock`ed: its lock goes.
            self.spawn(|fs| async move { fs.release_locks(ino.0, owner.0).await });
        }
        let staged = lock(&self.inner.writes).remove(&fh.0);
        if let Some(staged) = staged {
            // Whatever the last flush left unpublished goes now (errors: the log).
            self.spawn(|fs| async move {
                fs.release_write(staged).await;
                reply.ok();
            });
            return;
        }
        if let Some(file) = lock(&self.inner.files).remove(&fh.0) {
            let _runtime = self.rt.enter();
            file.release();
        }
        reply.ok();
    }

    fn flush(
        &self,
        req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        lock_owner: fuser::LockOwner,
        reply: ReplyEmpty,
    ) {
        // close(2) by the opener publishes (close-to-open); by another process (a
        // child closing an inherited descriptor at exec) it does not. Either way the
        // closing owner's record locks go (POSIX: any close by the owner drops them),
        // after what it wrote is published.
        let staged = lock(&self.inner.writes).get(&fh.0).cloned();
        let staged = staged.filter(|s| s.closed_by_opener(tgid_of(req.pid())));
        let locked = self.inner.locks.holds(ino.0, lock_owner.0);
        if staged.is_none() && !locked {
            return reply.ok();
        }
        self.spawn(|fs| async move {
            let got = match staged {
                Some(s) => fs.publish(&s).await,
                None => Ok(()),
            };
            if locked {
                fs.release_locks(ino.0, lock_owner.0).await;
            }
            match got {
                Ok(()) => reply.ok(),
                Err(e) => reply.error(fail("close", e)),
            }
        });
    }

    fn getlk(
        &self,
        _req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        lock_owner: fuser::LockOwner,
        start: u64,
        end: u64,
        typ: i32,
        pid: u32,
        reply: fuser::ReplyLock,
    ) {
        let ask = match crate::locks::ask_of((ino.0, fh.0, lock_owner.0), (start, end), typ, pid) {
            Ok(a) => a,
            Err(errno) => return reply.error(errno),
        };
        self.spawn(|fs| async move {
            let got = fs.test_lock(ask).await;
            crate::locks::answer_getlk(reply, ask, got)
        });
    }

    fn setlk(
        &self,
        req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        lock_owner: fuser::LockOwner,
        start: u64,
        end: u64,
        typ: i32,
        pid: u32,
        sleep: bool,
        reply: ReplyEmpty,
    ) {
        let ask = match crate::locks::ask_of((ino.0, fh.0, lock_owner.0), (start, end), typ, pid) {
            Ok(a) => a,
            Err(errno) => return reply.error(errno),
        };
        let waiter = sleep.then(|| req.pid());
        self.spawn(|fs| async move {
            let got = fs.set_lock(ask, waiter).await;
            crate::locks::answer_setlk(reply, got)
        });
    }

    fn fsync(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        _datasync: bool,
        reply: ReplyEmpty,
    ) {
        self.publish(fh, "fsync", reply);
    }

    fn opendir(&self, _req: &Request, ino: INodeNo, _flags: OpenFlags, reply: ReplyOpen) {
        self.spawn(|fs| async move {
            match fs.list(ino).await {
                Ok(fh) => reply.opened(FileHandle(fh), FopenFlags::empty()),
                Err(e) => reply.error(fail("opendir", e)),
            }
        });
    }

    fn readdir(
        &self,
        _req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        mut reply: ReplyDirectory,
    ) {
        let Some(listed) = lock(&self.inner.dirs).get(&fh.0).cloned() else {
            return reply.error(Errno::EBADF);
        };
        // Offsets: 1 is ".", 2 is "..", 3 + i is listed[i]; each entry carries the
        // offset of the one after it.
        let mut next = offset;
        loop {
            let full = match next {
                0 => reply.add(ino, 1, FileType::Directory, "."),
                1 => reply.add(INodeNo(ROOT), 2, FileType::Directory, ".."),
                n => match listed.get((n - 2) as usize) {
                    None => break,
                    Some((name, id, kind)) => {
                        reply.add(INodeNo(*id), n + 1, file_type(*kind), name)
                    }
                },
            };
            if full {
                break;
            }
            next += 1;
        }
        reply.ok();
    }

    fn releasedir(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        _flags: OpenFlags,
        reply: ReplyEmpty,
    ) {
        lock(&self.inner.dirs).remove(&fh.0);
        reply.ok();
    }

    fn statfs(&self, _req: &Request, _ino: INodeNo, reply: ReplyStatfs) {
        self.spawn(|fs| async move {
            let (capacity, free) = fs.nodes.space().await;
            let (blocks, free) = (capacity / BLOCK, free / BLOCK);
            reply.statfs(blocks, free, free, 0, 0, BLOCK as u32, 255, BLOCK as u32);
        });
    }

    fn access(&self, _req: &Request, _ino: INodeNo, mask: fuser::AccessFlags, reply: ReplyEmpty) {
        if mask.contains(fuser::AccessFlags::W_OK) && self.inner.writer.is_none() {
            return reply.error(read_only());
        }
        reply.ok();
    }

    fn getxattr(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _name: &OsStr,
        _size: u32,
        reply: fuser::ReplyXattr,
    ) {
        reply.error(Errno::ENODATA);
    }

    fn listxattr(&self, _req: &Request, _ino: INodeNo, size: u32, reply: fuser::ReplyXattr) {
        if size == 0 {
            reply.size(0);
        } else {
            reply.data(&[]);
        }
    }

    // Changes: [`write`] (EROFS on a read-only mount).

    fn setattr(
        &self,
        _req: &Request,
        ino: INodeNo,
        mode: Option<u32>,
        _uid: Option<u32>,
        _gid: Option<u32>,
        size: Option<u64>,
        _atime: Option<fuser::TimeOrNow>,
        mtime: Option<fuser::TimeOrNow>,
        _ctime: Option<SystemTime>,
        fh: Option<FileHandle>,
        _crtime: Option<SystemTime>,
        _chgtime: Option<SystemTime>,
        _bkuptime: Option<SystemTime>,
        _flags: Option<fuser::BsdFileFlags>,
        reply: ReplyAttr,
    ) {
        if self.inner.writer.is_none() {
            return reply.error(read_only());
        }
        // Owners are the mounting user's (not stored): chown changes nothing. Access
        // times are not kept.
        let staged = self.inner.staged_for(ino, fh);
        let on_handle = fh.is_some_and(|fh| lock(&self.inner.writes).contains_key(&fh.0));
        self.spawn(|fs| async move {
            let ttl = if staged.is_some() {
                Duration::ZERO
            } else {
                fs.opts.attr_ttl
            };
            match fs
                .set_attr(ino, (staged, on_handle), mode, size, mtime)
                .await
            {
                Ok(e) => reply.attr(&ttl, &fs.file_attr(ino.0, &e)),
                Err(e) => reply.error(fail("setattr", e)),
            }
        });
    }

    fn mknod(
        &self,
        _req: &Request,
        _parent: INodeNo,
        _name: &OsStr,
        _mode: u32,
        _umask: u32,
        _rdev: u32,
        reply: ReplyEntry,
    ) {
        // Regular files come through create; devices, fifos and sockets are not kept.
        let errno = if self.inner.writer.is_none() {
            read_only()
        } else {
            Errno::EPERM
        };
        reply.error(errno);
    }

    fn mkdir(
        &self,
        _req: &Request,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        umask: u32,
        reply: ReplyEntry,
    ) {
        let entry = Inner::new_entry(EntryKind::Dir, mode & !umask, None);
        self.make(parent, name, entry, "mkdir", reply);
    }

    fn unlink(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        self.remove(parent, name, false, reply);
    }

    fn rmdir(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        self.remove(parent, name, true, reply);
    }

    fn symlink(
        &self,
        _req: &Request,
        parent: INodeNo,
        link_name: &OsStr,
        target: &Path,
        reply: ReplyEntry,
    ) {
        let Some(target) = target.to_str().map(str::to_owned) else {
            return reply.error(Errno::EINVAL);
        };
        let entry = Inner::new_entry(EntryKind::Symlink, 0o777, Some(target));
        self.make(parent, link_name, entry, "symlink", reply);
    }

    fn rename(
        &self,
        _req: &Request,
        parent: INodeNo,
        name: &OsStr,
        newparent: INodeNo,
        newname: &OsStr,
        flags: fuser::RenameFlags,
        reply: ReplyEmpty,
    ) {
        let (name, newname) = (name.to_owned(), newname.to_owned());
        let flags = flags.bits();
        self.spawn(|fs| async move {
            match fs.rename(parent, &name, newparent, &newname, flags).await {
                Ok(()) => reply.ok(),
                Err(e) => reply.error(fail("rename", e)),
            }
        });
    }

    fn link(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _newparent: INodeNo,
        _newname: &OsStr,
        reply: ReplyEntry,
    ) {
        // Hard links are not kept in a cluster namespace.
        let errno = if self.inner.writer.is_none() {
            read_only()
        } else {
            Errno::EPERM
        };
        reply.error(errno);
    }

    fn write(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        data: &[u8],
        _write_flags: fuser::WriteFlags,
        _flags: OpenFlags,
        _lock_owner: Option<fuser::LockOwner>,
        reply: fuser::ReplyWrite,
    ) {
        if let Err(e) = self.inner.lock_lost(fh.0) {
            return reply.error(fail("write", e));
        }
        let Some(staged) = lock(&self.inner.writes).get(&fh.0).cloned() else {
            return reply.error(Errno::EBADF);
        };
        // A local file: written on this thread, unless a stripe must be fetched first
        // (or another change of the file is under way).
        match staged.try_write(offset, data) {
            Ok(true) => reply.written(data.len() as u32),
            Ok(false) => {
                let data = data.to_vec();
                self.spawn(|fs| async move {
                    let got = match fs.source() {
                        Ok(src) => staged.write(src, offset, &data).await,
                        Err(e) => Err(e),
                    };
                    match got {
                        Ok(()) => reply.written(data.len() as u32),
                        Err(e) => reply.error(fail("write", e)),
                    }
                })
            }
            Err(e) => reply.error(fail("write", e)),
        }
    }

    fn create(
        &self,
        req: &Request,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        umask: u32,
        flags: i32,
        reply: fuser::ReplyCreate,
    ) {
        if self.inner.writer.is_none() {
            return reply.error(read_only());
        }
        let name = name.to_owned();
        let opener = tgid_of(req.pid());
        self.spawn(|fs| async move {
            match fs.create(parent, &name, mode & !umask, flags, opener).await {
                Ok((ino, fh, entry)) => reply.created(
                    &Duration::ZERO,
                    &fs.file_attr(ino, &entry),
                    Generation(0),
                    FileHandle(fh),
                    FopenFlags::empty(),
                ),
                Err(e) => reply.error(fail("create", e)),
            }
        });
    }

    fn fallocate(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _fh: FileHandle,
        _offset: u64,
        _length: u64,
        _mode: i32,
        reply: ReplyEmpty,
    ) {
        let errno = if self.inner.writer.is_none() {
            read_only()
        } else {
            Errno::EOPNOTSUPP
        };
        reply.error(errno);
    }
}

impl ClusterFs {
    /// mkdir, symlink: puts `entry` as `name` in `parent`.
    fn make(
        &self,
        parent: INodeNo,
        name: &OsStr,
        entry: Entry,
        what: &'static str,
        reply: ReplyEntry,
    ) {
        let name = name.to_owned();
        self.spawn(|fs| async move {
            match fs.make(parent, &name, &entry).await {
                Ok(ino) => reply.entry_with_ttls(
                    &fs.opts.attr_ttl,
                    &fs.opts.entry_ttl,
                    &fs.file_attr(ino, &entry),
                    Generation(0),
                ),
                Err(e) => reply.error(fail(what, e)),
            }
        });
    }

    /// unlink (`dir` false), rmdir (`dir` true).
    fn remove(&self, parent: INodeNo, name: &OsStr, dir: bool, reply: ReplyEmpty) {
        let name = name.to_owned();
        self.spawn(|fs| async move {
            let what = if dir { "rmdir" } else { "unlink" };
            match fs.remove(parent, &name, dir).await {
                Ok(()) => reply.ok(),
                Err(e) => reply.error(fail(what, e)),
            }
        });
    }

    /// close or fsync of handle `fh`: a handle open for writing publishes what changed
    /// (EIO if that fails: nothing published); others have nothing to do.
    fn publish(&self, fh: FileHandle, what: &'static str, reply: ReplyEmpty) {
        let Some(staged) = lock(&self.inner.writes).get(&fh.0).cloned() else {
            return reply.ok();
        };
        self.spawn(|fs| async move {
            match fs.publish(&staged).await {
                Ok(()) => reply.ok(),
                Err(e) => reply.error(fail(what, e)),
            }
        });
    }
}
