//! The FUSE filesystem: kernel requests in, control messages and one-sided reads out.
//!
//! fuser calls these methods on its threads. Most hand the work to the tokio runtime
//! and return at once, and the reply is sent from the task when the answer is there,
//! so slow server round trips never hold up other requests. Reads, the hot path, are
//! answered on the fuser thread itself when their chunks are cached, and a miss
//! blocks that thread on the runtime while another fuser thread stays free
//! (`ThreadClaim`): each hand-off between threads costs a wake-up, which is most of
//! a 4 KiB read's latency on a small machine.

use std::collections::HashMap;
use std::ffi::OsStr;
use std::path::Path;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use ferry_common::msg::{Attr, DirEntry, FileKind, FileVersion, Timestamp};
use fuser::{
    Errno, FileAttr, FileHandle, FileType, FopenFlags, Generation, INodeNo, KernelConfig,
    OpenFlags, ReplyAttr, ReplyData, ReplyDirectory, ReplyEmpty, ReplyEntry, ReplyOpen,
    ReplyStatfs, Request,
};
use tokio::runtime::Handle;

use crate::nodes::{join, Nodes, ROOT};
use crate::options::MountOptions;
use crate::reader::{auto_chunk, OpenFile, Reader};
use crate::remote::{lock, OpError, Remote};

/// The mounted share.
pub struct FerryFs {
    inner: Arc<Inner>,
    rt: Handle,
}

struct Inner {
    remote: Arc<Remote>,
    reader: Arc<Reader>,
    share: String,
    /// Share-relative directory mounted as the root ("" for the share root).
    root: String,
    opts: MountOptions,
    uid: u32,
    gid: u32,
    nodes: Mutex<Nodes>,
    files: Mutex<HashMap<u64, Arc<OpenFile>>>,
    dirs: Mutex<HashMap<u64, Arc<Vec<DirEntry>>>>,
    /// The version each node was last opened at: the kernel may keep its page cache
    /// only when the next open finds the same version.
    versions: Mutex<HashMap<u64, FileVersion>>,
    next_fh: AtomicU64,
    /// fuser threads now blocked in a read (see [`ThreadClaim`]).
    blocked_reads: AtomicUsize,
}

/// One of the fuser threads blocked in a read until this drops.
///
/// Invariant: at most `threads - 1` are held at once, so one thread is always free to
/// take the kernel's next request (a lookup behind a slow read is not held up).
struct ThreadClaim<'a>(&'a AtomicUsize);

impl<'a> ThreadClaim<'a> {
    fn take(blocked: &'a AtomicUsize, threads: usize) -> Option<ThreadClaim<'a>> {
        blocked
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n + 1 < threads).then_some(n + 1)
            })
            .ok()
            .map(|_| ThreadClaim(blocked))
    }
}

impl Drop for ThreadClaim<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

impl FerryFs {
    /// A filesystem for `share/root` on `remote`, run on `rt`.
    pub fn new(
        rt: Handle,
        remote: Arc<Remote>,
        share: String,
        root: String,
        opts: MountOptions,
    ) -> FerryFs {
        let reader = Reader::new(remote.clone(), opts.cache_bytes, opts.readahead_chunks);
        FerryFs {
            inner: Arc::new(Inner {
                remote,
                reader,
                share,
                root,
                opts,
                uid: nix::unistd::getuid().as_raw(),
                gid: nix::unistd::getgid().as_raw(),
                nodes: Mutex::new(Nodes::new()),
                files: Mutex::new(HashMap::new()),
                dirs: Mutex::new(HashMap::new()),
                versions: Mutex::new(HashMap::new()),
                next_fh: AtomicU64::new(1),
                blocked_reads: AtomicUsize::new(0),
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

fn system(t: Timestamp) -> SystemTime {
    t.to_system()
}

impl Inner {
    /// The share-relative path of mount-relative `path`.
    fn share_path(&self, path: &str) -> String {
        match (self.root.is_empty(), path.is_empty()) {
            (true, _) => path.to_string(),
            (false, true) => self.root.clone(),
            (false, false) => format!("{}/{path}", self.root),
        }
    }

    fn path_of(&self, ino: INodeNo) -> Result<String, OpError> {
        lock(&self.nodes)
            .path(ino.0)
            .ok_or_else(|| OpError::new(Errno::ESTALE, format!("unknown inode {}", ino.0)))
    }

    fn file_attr(&self, ino: u64, a: &Attr) -> FileAttr {
        let kind = match a.kind {
            FileKind::Dir => FileType::Directory,
            FileKind::Symlink => FileType::Symlink,
            FileKind::File | FileKind::Other => FileType::RegularFile,
        };
        FileAttr {
            ino: INodeNo(ino),
            size: a.size,
            blocks: a.blocks,
            atime: system(a.atime),
            mtime: system(a.mtime),
            ctime: system(a.ctime),
            crtime: system(a.mtime),
            kind,
            perm: (a.mode & 0o7777) as u16,
            nlink: a.nlink.max(1),
            uid: self.uid,
            gid: self.gid,
            rdev: 0,
            blksize: 4096,
            flags: 0,
        }
    }

    /// Attributes of mount-relative `path`: from the cache within the attribute TTL,
    /// else from the server (symlinks not followed). A missing name is remembered for
    /// the negative TTL.
    async fn attr(&self, path: &str, ttl: std::time::Duration) -> Result<Attr, OpError> {
        let now = Instant::now();
        {
            let nodes = lock(&self.nodes);
            if let Some(a) = nodes.attr(path, now, ttl) {
                return Ok(a);
            }
            if nodes.is_missing(path, now, self.opts.negative_ttl) {
                return Err(OpError::new(
                    Errno::ENOENT,
                    format!("{path}: not found (cached)"),
                ));
            }
        }
        let sp = self.share_path(path);
        let share = self.share.clone();
        let got = self
            .remote
            .call(&format!("stat {share}/{sp}"), |c| async move {
                c.client.stat(&share, &sp, false).await
            })
            .await;
        let now = Instant::now();
        match got {
            Ok(a) => {
                lock(&self.nodes).store_attr(path, a.clone(), now);
                Ok(a)
            }
            Err(e) => {
                if e.errno == Errno::ENOENT && !self.opts.negative_ttl.is_zero() {
                    lock(&self.nodes).store_missing(path, now);
                }
                Err(e)
            }
        }
    }

    async fn lookup(&self, parent: INodeNo, name: &OsStr) -> Result<(u64, Attr), OpError> {
        let name = name
            .to_str()
            .ok_or_else(|| OpError::new(Errno::ENOENT, "name is not UTF-8"))?;
        let path = join(&self.path_of(parent)?, name);
        let attr = self
            .attr(&path, self.opts.entry_ttl.min(self.opts.attr_ttl))
            .await?;
        let ino = lock(&self.nodes).remember(&path, (attr.dev, attr.ino));
        Ok((ino, attr))
    }

    async fn open(&self, ino: INodeNo) -> Result<(u64, bool), OpError> {
        let path = self.path_of(ino)?;
        let sp = self.share_path(&path);
        // The size from the lookup that preceded the open, however old: it only picks
        // the chunk size, which the server's reply then fixes for this open.
        let chunk_bytes = self.opts.chunk_bytes.unwrap_or_else(|| {
            let size = lock(&self.nodes)
                .attr(&path, Instant::now(), Duration::MAX)
                .map_or(0, |a| a.size);
            auto_chunk(size)
        });
        let file = self.reader.open(&self.share, &sp, chunk_bytes).await?;
        let version = file.version();
        lock(&self.nodes).store_attr(&path, file.attr(), Instant::now());
        let keep = lock(&self.versions).insert(ino.0, version) == Some(version);
        let fh = self.next_fh.fetch_add(1, Ordering::Relaxed);
        lock(&self.files).insert(fh, Arc::new(file));
        Ok((fh, keep))
    }

    async fn list(&self, ino: INodeNo) -> Result<u64, OpError> {
        let path = self.path_of(ino)?;
        let sp = self.share_path(&path);
        let share = self.share.clone();
        let entries = self
            .remote
            .call(&format!("list {share}/{sp}"), |c| async move {
                c.client.list_dir(&share, &sp).await
            })
            .await?;
        let now = Instant::now();
        {
            let mut nodes = lock(&self.nodes);
            for e in &entries {
                nodes.store_attr(&join(&path, &e.name), e.attr.clone(), now);
            }
        }
        let fh = self.next_fh.fetch_add(1, Ordering::Relaxed);
        lock(&self.dirs).insert(fh, Arc::new(entries));
        Ok(fh)
    }
}

/// Replies to a read with its bytes (handing the buffer back to `reader`) or its error.
fn answer_read(reader: &Reader, reply: ReplyData, got: Result<Vec<u8>, OpError>) {
    match got {
        Ok(data) => {
            reply.data(&data);
            reader.recycle(data);
        }
        Err(e) => reply.error(fail("read", e)),
    }
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

impl fuser::Filesystem for FerryFs {
    fn init(&mut self, _req: &Request, config: &mut KernelConfig) -> std::io::Result<()> {
        // Let the kernel read ahead in large requests; Ferry's own readahead runs on top.
        let _ = config.set_max_readahead(1 << 20);
        Ok(())
    }

    fn lookup(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEntry) {
        let name = name.to_owned();
        self.spawn(|fs| async move {
            match fs.lookup(parent, &name).await {
                Ok((ino, attr)) => reply.entry_with_ttls(
                    &fs.opts.attr_ttl,
                    &fs.opts.entry_ttl,
                    &fs.file_attr(ino, &attr),
                    Generation(0),
                ),
                Err(e) => reply.error(fail("lookup", e)),
            }
        });
    }

    fn forget(&self, _req: &Request, ino: INodeNo, nlookup: u64) {
        lock(&self.inner.nodes).forget(ino.0, nlookup);
    }

    fn getattr(&self, _req: &Request, ino: INodeNo, _fh: Option<FileHandle>, reply: ReplyAttr) {
        self.spawn(|fs| async move {
            let got = match fs.path_of(ino) {
                Ok(path) => fs.attr(&path, fs.opts.attr_ttl).await,
                Err(e) => Err(e),
            };
            match got {
                Ok(a) => reply.attr(&fs.opts.attr_ttl, &fs.file_attr(ino.0, &a)),
                Err(e) => reply.error(fail("getattr", e)),
            }
        });
    }

    fn readlink(&self, _req: &Request, ino: INodeNo, reply: ReplyData) {
        self.spawn(|fs| async move {
            let got = match fs.path_of(ino) {
                Ok(path) => fs.attr(&path, fs.opts.attr_ttl).await,
                Err(e) => Err(e),
            };
            match got {
                Ok(Attr {
                    symlink_target: Some(t),
                    ..
                }) => reply.data(t.as_bytes()),
                Ok(_) => reply.error(Errno::EINVAL),
                Err(e) => reply.error(fail("readlink", e)),
            }
        });
    }

    fn open(&self, _req: &Request, ino: INodeNo, flags: OpenFlags, reply: ReplyOpen) {
        let acc = flags.0 & nix::libc::O_ACCMODE;
        if acc != nix::libc::O_RDONLY || flags.0 & nix::libc::O_TRUNC != 0 {
            reply.error(Errno::EROFS);
            return;
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
        let Some(file) = lock(&self.inner.files).get(&fh.0).cloned() else {
            reply.error(Errno::EBADF);
            return;
        };
        let reader = &self.inner.reader;
        // Cached chunks are answered on this thread: no hand-off, no wake-up.
        let cached = {
            let _runtime = self.rt.enter();
            file.read_cached(reader, offset, size)
        };
        if let Some(data) = cached {
            return answer_read(reader, reply, Ok(data));
        }
        // A miss is read on this thread too while another stays free for the kernel's
        // other requests; past that, on the runtime.
        if let Some(_held) = ThreadClaim::take(&self.inner.blocked_reads, self.inner.opts.threads) {
            let got = self.rt.block_on(file.read(reader, offset, size));
            return answer_read(reader, reply, got);
        }
        self.spawn(|fs| async move {
            let got = file.read(&fs.reader, offset, size).await;
            answer_read(&fs.reader, reply, got);
        });
    }

    fn release(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        _flags: OpenFlags,
        _lock_owner: Option<fuser::LockOwner>,
        _flush: bool,
        reply: ReplyEmpty,
    ) {
        if let Some(file) = lock(&self.inner.files).remove(&fh.0) {
            let _guard = self.rt.enter();
            file.release();
        }
        reply.ok();
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
        let Some(entries) = lock(&self.inner.dirs).get(&fh.0).cloned() else {
            reply.error(Errno::EBADF);
            return;
        };
        // Offsets: 1 is ".", 2 is "..", 3 + i is entries[i]; each entry carries the
        // offset of the one after it.
        let mut next = offset;
        loop {
            let full = match next {
                0 => reply.add(ino, 1, FileType::Directory, "."),
                1 => reply.add(INodeNo(ROOT), 2, FileType::Directory, ".."),
                n => match entries.get((n - 2) as usize) {
                    None => break,
                    Some(e) => {
                        let kind = match e.attr.kind {
                            FileKind::Dir => FileType::Directory,
                            FileKind::Symlink => FileType::Symlink,
                            FileKind::File | FileKind::Other => FileType::RegularFile,
                        };
                        reply.add(INodeNo(e.attr.ino.max(2)), n + 1, kind, &e.name)
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
            let share = fs.share.clone();
            match fs
                .remote
                .call("statfs", |c| async move { c.client.statfs(&share).await })
                .await
            {
                Ok(s) => reply.statfs(
                    s.blocks,
                    s.blocks_free,
                    s.blocks_avail,
                    s.files,
                    s.files_free,
                    s.block_size,
                    s.name_max,
                    s.block_size,
                ),
                Err(e) => reply.error(fail("statfs", e)),
            }
        });
    }

    fn flush(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _fh: FileHandle,
        _lock_owner: fuser::LockOwner,
        reply: ReplyEmpty,
    ) {
        // Nothing is ever written, so there is nothing to flush.
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
        // Extended attributes are not exported.
        reply.error(Errno::ENODATA);
    }

    fn listxattr(&self, _req: &Request, _ino: INodeNo, size: u32, reply: fuser::ReplyXattr) {
        if size == 0 {
            reply.size(0);
        } else {
            reply.data(&[]);
        }
    }

    // Every change is refused: the mount is read-only (the kernel refuses most of
    // these already because it is mounted `ro`).

    fn setattr(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _mode: Option<u32>,
        _uid: Option<u32>,
        _gid: Option<u32>,
        _size: Option<u64>,
        _atime: Option<fuser::TimeOrNow>,
        _mtime: Option<fuser::TimeOrNow>,
        _ctime: Option<SystemTime>,
        _fh: Option<FileHandle>,
        _crtime: Option<SystemTime>,
        _chgtime: Option<SystemTime>,
        _bkuptime: Option<SystemTime>,
        _flags: Option<fuser::BsdFileFlags>,
        reply: ReplyAttr,
    ) {
        reply.error(Errno::EROFS);
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
        reply.error(Errno::EROFS);
    }

    fn mkdir(
        &self,
        _req: &Request,
        _parent: INodeNo,
        _name: &OsStr,
        _mode: u32,
        _umask: u32,
        reply: ReplyEntry,
    ) {
        reply.error(Errno::EROFS);
    }

    fn unlink(&self, _req: &Request, _parent: INodeNo, _name: &OsStr, reply: ReplyEmpty) {
        reply.error(Errno::EROFS);
    }

    fn rmdir(&self, _req: &Request, _parent: INodeNo, _name: &OsStr, reply: ReplyEmpty) {
        reply.error(Errno::EROFS);
    }

    fn symlink(
        &self,
        _req: &Request,
        _parent: INodeNo,
        _link_name: &OsStr,
        _target: &Path,
        reply: ReplyEntry,
    ) {
        reply.error(Errno::EROFS);
    }

    fn rename(
        &self,
        _req: &Request,
        _parent: INodeNo,
        _name: &OsStr,
        _newparent: INodeNo,
        _newname: &OsStr,
        _flags: fuser::RenameFlags,
        reply: ReplyEmpty,
    ) {
        reply.error(Errno::EROFS);
    }

    fn link(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _newparent: INodeNo,
        _newname: &OsStr,
        reply: ReplyEntry,
    ) {
        reply.error(Errno::EROFS);
    }

    fn write(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _fh: FileHandle,
        _offset: u64,
        _data: &[u8],
        _write_flags: fuser::WriteFlags,
        _flags: OpenFlags,
        _lock_owner: Option<fuser::LockOwner>,
        reply: fuser::ReplyWrite,
    ) {
        reply.error(Errno::EROFS);
    }

    fn create(
        &self,
        _req: &Request,
        _parent: INodeNo,
        _name: &OsStr,
        _mode: u32,
        _umask: u32,
        _flags: i32,
        reply: fuser::ReplyCreate,
    ) {
        reply.error(Errno::EROFS);
    }
}
