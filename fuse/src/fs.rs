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
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant, SystemTime};

use ferry_common::msg::{
    Attr, DirEntry, FileKind, FileVersion, HashAlgorithm, NodeKind, TimeSet, Timestamp,
    MAX_NAME_BYTES, MAX_PATH_BYTES,
};
use fuser::{
    Errno, FileAttr, FileHandle, FileType, FopenFlags, Generation, INodeNo, KernelConfig,
    OpenFlags, ReplyAttr, ReplyData, ReplyDirectory, ReplyEmpty, ReplyEntry, ReplyOpen,
    ReplyStatfs, Request,
};
use tokio::runtime::Handle;

use crate::locks::{LockAsk, LockBackend, Locks, ServerLocks};
use crate::nodes::{join, Nodes, ROOT};
use crate::options::MountOptions;
use crate::reader::{auto_chunk, OpenFile, Reader};
use crate::remote::{errno_of, lock, OpError, Remote};
use crate::writer::WriteFile;

mod xattr;

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
    /// fuser threads now blocked in a read or write (see [`ThreadClaim`]).
    blocked_reads: AtomicUsize,
    /// The mount may write (see `options::Write`).
    writable: bool,
    /// Files open for writing, by node: every descriptor of a node shares one.
    wfiles: Mutex<HashMap<u64, Arc<WriteFile>>>,
    /// Writable descriptors: node and file.
    wfhs: Mutex<HashMap<u64, (u64, Arc<WriteFile>)>>,
    /// The thread that opened each writable descriptor: a `close` by its process gives
    /// a staged file its name; a close by another process sharing the descriptor (a
    /// child's close-on-exec after fork) only writes back.
    openers: Mutex<HashMap<u64, u32>>,
    /// Created or truncated files that have not taken their name on the server yet,
    /// by mount-relative path: lookups and listings show them.
    staged: Mutex<HashMap<String, (u64, Arc<WriteFile>)>>,
    /// Write generation of each node written through this mount: a read descriptor
    /// opened at an older one maps the file again, so it never reads bytes older than
    /// this mount's writes.
    gens: Mutex<HashMap<u64, u64>>,
    /// The node and write generation each read descriptor was opened at.
    read_gens: Mutex<HashMap<u64, (u64, u64)>>,
    /// Held while a descriptor is opened for writing, so two opens of one node make one
    /// server handle.
    open_lock: tokio::sync::Mutex<()>,
    /// Show the server's numeric owners (a writable mount run by root, as
    /// `sshfs -o idmap=none`); otherwise every file shows as the mounting user's.
    show_owners: bool,
    /// Directories this mount made, and when: for `negative_timeout` after, a name in
    /// one that this mount did not put there is missing without asking the server (as
    /// if a listing had just shown it empty), which spares unpacking a tree one round
    /// trip a file.
    fresh_dirs: Mutex<HashMap<String, Instant>>,
    /// The owners the server reported, by server file.
    owners: Mutex<HashMap<(u64, u64), ferry_common::msg::Owner>>,
    /// Where this is mounted (absolute), if known: it finds this mount's id.
    mountpoint: Option<PathBuf>,
    /// This mount's id (`/proc/self/mountinfo`), read at the first close that needs
    /// it; `None` inside when it could not be found.
    mount_id: OnceLock<Option<u64>>,
    /// The session's channel for telling the kernel to drop what it cached of a node
    /// (set once the session exists, [`FerryFs::notifier_slot`]).
    notifier: Arc<OnceLock<fuser::Notifier>>,
    /// The file locks taken through this mount ([`crate::locks`]).
    locks: Locks,
    /// Nodes found without `security.capability`, and when (see [`xattr`]).
    no_capability: Mutex<HashMap<u64, Instant>>,
}

/// Owners remembered before the table is emptied (it refills from the next lookups).
const OWNERS_KEPT: usize = 200_000;

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
        writable: bool,
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
                writable,
                wfiles: Mutex::new(HashMap::new()),
                wfhs: Mutex::new(HashMap::new()),
                openers: Mutex::new(HashMap::new()),
                staged: Mutex::new(HashMap::new()),
                gens: Mutex::new(HashMap::new()),
                read_gens: Mutex::new(HashMap::new()),
                open_lock: tokio::sync::Mutex::new(()),
                show_owners: writable && nix::unistd::getuid().is_root(),
                owners: Mutex::new(HashMap::new()),
                fresh_dirs: Mutex::new(HashMap::new()),
                mountpoint: None,
                mount_id: OnceLock::new(),
                notifier: Arc::new(OnceLock::new()),
                locks: Locks::new(),
                no_capability: Mutex::new(HashMap::new()),
            }),
            rt,
        }
    }

    /// Where the session's [`fuser::Notifier`] goes once the session exists: until it
    /// is set, an open cannot drop attributes the kernel cached (close-to-open then
    /// holds only after `attr_timeout`).
    pub fn notifier_slot(&self) -> Arc<OnceLock<fuser::Notifier>> {
        self.inner.notifier.clone()
    }

    /// Tells the filesystem its absolute mountpoint (resolved before mounting), so that
    /// a close can tell whether the closing process still holds another descriptor of
    /// the file ([`holds_descriptor`]). Without it, every close by the opener names a
    /// staged file.
    pub fn with_mountpoint(mut self, absolute: PathBuf) -> FerryFs {
        if let Some(inner) = Arc::get_mut(&mut self.inner) {
            inner.mountpoint = Some(absolute);
        }
        self
    }

    /// Runs `f` on the runtime with the shared state.
    fn spawn<F, Fut>(&self, f: F)
    where
        F: FnOnce(Arc<Inner>) -> Fut,
        Fut: std::future::Future<Output = ()> + Send + 'static,
    {
        self.rt.spawn(f(self.inner.clone()));
    }

    /// Runs `f` on this fuser thread while another stays free for the kernel's next
    /// request, else on the runtime. A request answered from memory, or after one
    /// round trip, then costs no hand-off between threads (each wake-up of another
    /// thread is tens of microseconds on a small VM).
    fn run<F, Fut>(&self, f: F)
    where
        F: FnOnce(Arc<Inner>) -> Fut,
        Fut: std::future::Future<Output = ()> + Send + 'static,
    {
        if let Some(_held) = ThreadClaim::take(&self.inner.blocked_reads, self.inner.opts.threads) {
            return self.rt.block_on(f(self.inner.clone()));
        }
        self.spawn(f);
    }
}

impl FerryFs {
    /// [`FerryFs::run`] with every request `f` sends acting as the caller of `req`
    /// (see `ferry_client::posix`).
    fn run_as<F, Fut>(&self, req: &Request, f: F)
    where
        F: FnOnce(Arc<Inner>) -> Fut,
        Fut: std::future::Future<Output = ()> + Send + 'static,
    {
        let caller = caller_of(req);
        self.run(move |fs| ferry_client::posix::as_caller(caller, f(fs)));
    }

    /// [`FerryFs::spawn`] acting as the caller of `req`, as [`FerryFs::run_as`].
    fn spawn_as<F, Fut>(&self, req: &Request, f: F)
    where
        F: FnOnce(Arc<Inner>) -> Fut,
        Fut: std::future::Future<Output = ()> + Send + 'static,
    {
        let caller = caller_of(req);
        self.spawn(move |fs| ferry_client::posix::as_caller(caller, f(fs)));
    }
}

/// The caller of a kernel request: its ids and its thread's supplementary groups.
fn caller_of(req: &Request) -> ferry_common::msg::Caller {
    ferry_client::posix::caller_of(req.pid(), req.uid(), req.gid())
}

/// What the kernel is told a node of `kind` is.
fn file_type(kind: FileKind) -> FileType {
    match kind {
        FileKind::Dir => FileType::Directory,
        FileKind::Symlink => FileType::Symlink,
        FileKind::File | FileKind::Other => FileType::RegularFile,
        FileKind::Node { kind, .. } => match kind {
            NodeKind::Fifo => FileType::NamedPipe,
            NodeKind::Socket => FileType::Socket,
            NodeKind::Char => FileType::CharDevice,
            NodeKind::Block => FileType::BlockDevice,
        },
    }
}

fn system(t: Timestamp) -> SystemTime {
    t.to_system()
}

impl Inner {
    /// Whether the process of thread `tid` still holds a descriptor of node `ino` on
    /// this mount (see [`holds_descriptor`]); false when the mount's id is unknown.
    fn holds_another(&self, tid: u32, ino: u64) -> bool {
        let id = self.mount_id.get_or_init(|| {
            self.mountpoint
                .as_deref()
                .and_then(|at| crate::mount::fuse_mount_at(at).ok())
                .map(|m| m.id)
        });
        id.is_some_and(|id| holds_descriptor(tid, id, ino))
    }

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

    fn remember_owner(&self, a: &Attr, owner: ferry_common::msg::Owner) {
        if self.show_owners {
            let mut owners = lock(&self.owners);
            if owners.len() >= OWNERS_KEPT {
                owners.clear();
            }
            owners.insert((a.dev, a.ino), owner);
        }
    }

    fn file_attr(&self, ino: u64, a: &Attr) -> FileAttr {
        let owner = if self.show_owners {
            lock(&self.owners).get(&(a.dev, a.ino)).copied()
        } else {
            None
        };
        let kind = file_type(a.kind);
        let rdev = match a.kind {
            FileKind::Node { rdev, .. } => u32::try_from(rdev).unwrap_or(0),
            _ => 0,
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
            uid: owner.map_or(self.uid, |o| o.uid),
            gid: owner.map_or(self.gid, |o| o.gid),
            rdev,
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
        let meta = self.show_owners;
        let got = self
            .remote
            .call(&format!("stat {share}/{sp}"), |c| async move {
                if meta {
                    c.client
                        .stat_meta(&share, &sp, false)
                        .await
                        .map(|(a, o)| (a, Some(o)))
                } else {
                    c.client.stat(&share, &sp, false).await.map(|a| (a, None))
                }
            })
            .await;
        let got = got.map(|(a, owner)| {
            if let Some(o) = owner {
                self.remember_owner(&a, o);
            }
            a
        });
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
        check_name_len(name)?;
        let dir = self.path_of(parent)?;
        let path = join(&dir, name);
        let staged = lock(&self.staged).get(&path).map(|(_, wf)| wf.clone());
        if staged.is_none() && self.fresh_and_unknown(&dir, &path) {
            return Err(OpError::new(
                Errno::ENOENT,
                format!("{path}: not found (a directory this mount just made)"),
            ));
        }
        let attr = match staged {
            Some(wf) => wf.attr(),
            None => {
                self.attr(&path, self.opts.entry_ttl.min(self.opts.attr_ttl))
                    .await?
            }
        };
        let ino = lock(&self.nodes).remember(&path, (attr.dev, attr.ino));
        // A node open for writing here: its size and times as this mount's writes
        // left them (the server has not seen all of them yet).
        let attr = self.wfile(ino).map_or(attr, |wf| wf.attr());
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
        let before = lock(&self.nodes).attr(&path, Instant::now(), Duration::MAX);
        let file = self.reader.open(&self.share, &sp, chunk_bytes).await?;
        if let Err(e) = self.check_same_file(ino.0, &path, &file.attr()) {
            file.release();
            return Err(e);
        }
        let version = file.version();
        lock(&self.nodes).store_attr(&path, file.attr(), Instant::now());
        self.revalidated(ino.0, before.as_ref(), &file.attr());
        let keep = lock(&self.versions).insert(ino.0, version) == Some(version);
        let fh = self.next_fh.fetch_add(1, Ordering::Relaxed);
        lock(&self.read_gens).insert(fh, (ino.0, self.gen_of(ino.0)));
        lock(&self.files).insert(fh, Arc::new(file));
        Ok((fh, keep))
    }

    /// Maps node `ino` again for read descriptor `fh` (it was written through this
    /// mount since `fh` mapped it).
    async fn reopen(&self, ino: INodeNo, fh: u64) -> Result<Arc<OpenFile>, OpError> {
        let gen = self.gen_of(ino.0);
        let path = self.path_of(ino)?;
        let sp = self.share_path(&path);
        let chunk_bytes = self.opts.chunk_bytes.unwrap_or_else(|| {
            let size = lock(&self.nodes)
                .attr(&path, Instant::now(), Duration::MAX)
                .map_or(0, |a| a.size);
            auto_chunk(size)
        });
        let file = Arc::new(self.reader.open(&self.share, &sp, chunk_bytes).await?);
        if let Some(old) = lock(&self.files).insert(fh, file.clone()) {
            old.release();
        }
        lock(&self.read_gens).insert(fh, (ino.0, gen));
        Ok(file)
    }

    async fn list(&self, ino: INodeNo) -> Result<u64, OpError> {
        let path = self.path_of(ino)?;
        let sp = self.share_path(&path);
        let share = self.share.clone();
        let meta = self.show_owners;
        let listed = self
            .remote
            .call(&format!("list {share}/{sp}"), |c| async move {
                if meta && c.client.has_meta() {
                    let (_, page) = c.client.list_dir_meta(&share, &sp).await?;
                    Ok(page.into_iter().map(|(e, o)| (e, Some(o))).collect())
                } else {
                    let page = c.client.list_dir(&share, &sp).await?;
                    Ok(page.into_iter().map(|e| (e, None)).collect::<Vec<_>>())
                }
            })
            .await?;
        let entries: Vec<DirEntry> = listed
            .into_iter()
            .filter(|(e, _)| {
                // A lying server's `a/b` or `..` never reaches the kernel or a path.
                let ok = ferry_common::path::valid_name(&e.name);
                if !ok {
                    tracing::warn!(
                        dir = path,
                        name = e.name,
                        "ignoring an invalid name the server listed"
                    );
                }
                ok
            })
            .map(|(e, owner)| {
                if let Some(o) = owner {
                    self.remember_owner(&e.attr, o);
                }
                e
            })
            .collect();
        let now = Instant::now();
        {
            let mut nodes = lock(&self.nodes);
            for e in &entries {
                nodes.store_attr(&join(&path, &e.name), e.attr.clone(), now);
            }
        }
        let mut entries = entries;
        for (p, (_, wf)) in lock(&self.staged).iter() {
            let (dir, name) = match p.rsplit_once('/') {
                Some((d, n)) => (d, n),
                None => ("", p.as_str()),
            };
            if dir == path && !entries.iter().any(|e| e.name == name) {
                entries.push(DirEntry {
                    name: name.to_string(),
                    attr: wf.attr(),
                });
            }
        }
        let fh = self.next_fh.fetch_add(1, Ordering::Relaxed);
        lock(&self.dirs).insert(fh, Arc::new(entries));
        Ok(fh)
    }
}

/// Whether thread `tid` belongs to the process of thread `opener` (alive): one `stat`
/// of `/proc/<opener>/task/<tid>`, not a read of `/proc/<tid>/status`. An opener
/// thread that has exited counts as another process (its file is then published at
/// its last release instead of this close).
/// A `write` through `wf`: at `offset`, or with `append` at the end of the file as the
/// handle knows it ([`WriteFile::append`]).
async fn write_or_append(
    wf: &Arc<WriteFile>,
    append: bool,
    offset: u64,
    data: &[u8],
) -> Result<(), OpError> {
    if append {
        wf.append(data).await.map(|_| ())
    } else {
        wf.write(offset, data).await
    }
}

fn same_process(opener: u32, tid: u32) -> bool {
    tid == opener || Path::new(&format!("/proc/{opener}/task/{tid}")).exists()
}

/// How the kernel is to treat a descriptor opened for writing with `flags`: a
/// write-only one (`dd of=`, `cmd > file`, `cp`, `tar x`) bypasses the kernel's page
/// cache (`FOPEN_DIRECT_IO`), so each `write` goes straight from the writer's memory
/// into this mount's write-back buffer, with no page-cache page to allocate, copy into
/// and keep. Such a descriptor can neither read nor be mapped (a mapping needs read
/// access), so nothing is lost; other descriptors of the file keep the page cache,
/// which the kernel invalidates over the range of each direct write. Descriptors that
/// can also read (a database, `git`'s packs, `rsync`'s temporary files) keep the page
/// cache, which serves their reads.
fn write_open_flags(flags: i32) -> FopenFlags {
    if flags & nix::libc::O_ACCMODE == nix::libc::O_WRONLY {
        FopenFlags::FOPEN_DIRECT_IO
    } else {
        FopenFlags::empty()
    }
}

/// The most descriptors of one process [`holds_descriptor`] looks at.
const FDS_LOOKED_AT: usize = 4096;

/// Whether the process of thread `tid` holds a descriptor of node `ino` of the mount
/// with id `mount_id`, from its `/proc/<tid>/fdinfo` entries (`mnt_id:` and `ino:`;
/// procfs only, nothing here calls into this mount). False where `/proc` cannot tell:
/// another user's process, a kernel without `ino:` there (before 5.19), more than
/// [`FDS_LOOKED_AT`] descriptors.
///
/// A `close` is sent after the descriptor left the process's table, so a hit is
/// another descriptor: `cmd > file` opens the file, `dup2`s it onto 1 and closes the
/// first, and that close is not the end of the writing.
fn holds_descriptor(tid: u32, mount_id: u64, ino: u64) -> bool {
    let Ok(dir) = std::fs::read_dir(format!("/proc/{tid}/fdinfo")) else {
        return false;
    };
    for (i, entry) in dir.enumerate() {
        if i >= FDS_LOOKED_AT {
            return false;
        }
        let Some(text) = entry
            .ok()
            .and_then(|e| std::fs::read_to_string(e.path()).ok())
        else {
            continue;
        };
        let field = |name: &str| -> Option<u64> {
            text.lines()
                .find_map(|l| l.strip_prefix(name))
                .and_then(|v| v.trim().parse().ok())
        };
        if field("mnt_id:") == Some(mount_id) && field("ino:") == Some(ino) {
            return true;
        }
    }
    false
}

/// The process (thread group) of thread `tid`, from `/proc`.
pub(crate) fn tgid_of(tid: u32) -> Option<u32> {
    let status = std::fs::read_to_string(format!("/proc/{tid}/status")).ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("Tgid:"))
        .and_then(|v| v.trim().parse().ok())
}

/// The directory holding mount-relative `path` ("" for the root).
/// `ENAMETOOLONG` for a name longer than a name may be (`NAME_MAX`, the protocol's and
/// every Linux file system's 255 bytes): the kernel hands a FUSE file system names up
/// to 1,024 bytes.
fn check_name_len(name: &str) -> Result<(), OpError> {
    if name.len() > MAX_NAME_BYTES {
        return Err(OpError::new(
            Errno::ENAMETOOLONG,
            format!("a name of {} bytes (at most {MAX_NAME_BYTES})", name.len()),
        ));
    }
    Ok(())
}

fn parent_of(path: &str) -> &str {
    path.rsplit_once('/').map_or("", |(dir, _)| dir)
}

/// The errno for a change asked of a read-only mount.
fn read_only() -> OpError {
    OpError::new(Errno::EROFS, "the mount is read-only")
}

/// A time of a `setattr` as `utimensat` has it: omitted, now, or given.
fn time_set(t: Option<fuser::TimeOrNow>) -> TimeSet {
    match t {
        None => TimeSet::Omit,
        Some(fuser::TimeOrNow::Now) => TimeSet::Now,
        Some(fuser::TimeOrNow::SpecificTime(t)) => TimeSet::At(Timestamp::from_system(t)),
    }
}

fn timestamp(t: fuser::TimeOrNow) -> Timestamp {
    match t {
        fuser::TimeOrNow::SpecificTime(t) => Timestamp::from_system(t),
        fuser::TimeOrNow::Now => Timestamp::from_system(SystemTime::now()),
    }
}

/// What a writable open asks of the server.
#[derive(Debug, Clone, Copy)]
struct WriteOpen {
    create: Option<u32>,
    exclusive: bool,
    truncate: bool,
}

impl Inner {
    fn gen_of(&self, ino: u64) -> u64 {
        lock(&self.gens).get(&ino).copied().unwrap_or(0)
    }

    /// The node's content changed on the server through this mount.
    fn bump(&self, ino: u64) {
        *lock(&self.gens).entry(ino).or_insert(0) += 1;
    }

    fn wfile(&self, ino: u64) -> Option<Arc<WriteFile>> {
        lock(&self.wfiles).get(&ino).cloned()
    }

    /// Records what the server said of `path` after a change through this mount (a
    /// staged file taking its name changed its directory too).
    fn settled(&self, ino: u64, path: &str, attr: &Attr) {
        let mut nodes = lock(&self.nodes);
        // Only while `path` still names the node: a rename or unlink meanwhile must
        // not be undone in the cache.
        if nodes.id_of(path) == Some(ino) {
            nodes.store_attr(path, attr.clone(), Instant::now());
        }
        // A file this mount created has its server file now, and keeps the owner it
        // was shown with until its attributes are fetched again.
        let was = nodes.key(ino);
        nodes.rekey(ino, (attr.dev, attr.ino));
        if let Some((dev, old)) = was {
            let mut owners = lock(&self.owners);
            if let Some(o) = owners.get(&(dev, old)).copied() {
                owners.insert((attr.dev, attr.ino), o);
            }
        }
        nodes.changed(parent_of(path));
        drop(nodes);
        lock(&self.staged).remove(path);
        self.bump(ino);
    }

    /// Answers a close or fsync of node `ino`: what the server said of it is
    /// recorded under the name the node has now.
    fn answer_sync(&self, ino: u64, got: Result<Attr, OpError>, op: &str, reply: ReplyEmpty) {
        match got {
            Ok(attr) => {
                if let Ok(path) = self.path_of(INodeNo(ino)) {
                    self.settled(ino, &path, &attr);
                }
                reply.ok()
            }
            Err(e) => reply.error(fail(op, e)),
        }
    }

    /// Gives a staged file written through this mount its name now (a namespace
    /// change is about to name it), so the server's namespace is what this mount shows.
    async fn name_staged(&self, path: &str) -> Result<(), OpError> {
        let staged = lock(&self.staged).get(path).cloned();
        if let Some((ino, wf)) = staged {
            let attr = wf.sync(false).await?;
            self.settled(ino, path, &attr);
        }
        Ok(())
    }

    /// Opens node `ino` (at mount-relative `path`) for writing: a new server handle,
    /// or one more descriptor of the node's open one. Returns the descriptor.
    async fn open_write(
        &self,
        ino: u64,
        path: &str,
        how: WriteOpen,
    ) -> Result<(u64, Attr), OpError> {
        if !self.writable {
            return Err(read_only());
        }
        let _one = self.open_lock.lock().await;
        let before = lock(&self.nodes).attr(path, Instant::now(), Duration::MAX);
        let wf = match self.wfile(ino) {
            Some(wf) => {
                wf.add_ref();
                // Close-to-open: the handle may predate another client's close (or be
                // one whose release is still on its way); its size and times are
                // asked of the server again.
                if let Err(e) = wf.revalidate().await {
                    wf.drop_ref();
                    return Err(e);
                }
                if how.truncate {
                    let attrs = ferry_common::msg::SetAttrs {
                        size: Some(0),
                        ..Default::default()
                    };
                    if let Err(e) = wf.set_attr(attrs).await {
                        wf.drop_ref();
                        return Err(e);
                    }
                }
                wf
            }
            None => {
                let sp = self.share_path(path);
                let share = self.share.clone();
                let label = format!("{share}/{sp}");
                let (conn, opened, algorithm) = self
                    .remote
                    .call(&format!("open {label}"), |c| async move {
                        let a = c.client.share_hash(&share).await?;
                        let o = c
                            .client
                            .file_open(&share, &sp, how.create, how.exclusive, how.truncate)
                            .await?;
                        Ok((c, o, a))
                    })
                    .await?;
                let staged = opened.staged;
                // A staged file is a new server file by design; an open in place must
                // be of the file the node is.
                if !staged {
                    if let Err(e) = self.check_same_file(ino, path, &opened.attr) {
                        let handle = opened.handle;
                        let _ = conn.client.file_close(handle).await;
                        return Err(e);
                    }
                }
                let wf = WriteFile::new(self.remote.clone(), conn, label, opened, algorithm)?;
                lock(&self.wfiles).insert(ino, wf.clone());
                if staged {
                    lock(&self.staged).insert(path.to_string(), (ino, wf.clone()));
                }
                lock(&self.nodes).changed(path);
                wf
            }
        };
        let attr = wf.attr();
        self.revalidated(ino, before.as_ref(), &attr);
        let fh = self.next_fh.fetch_add(1, Ordering::Relaxed);
        lock(&self.wfhs).insert(fh, (ino, wf));
        Ok((fh, attr))
    }

    /// Fails with `ESTALE` when the server file an open of node `ino` found at `path`
    /// (`fresh`) is not the file the node is (its name was replaced by a rename or a
    /// copy since the kernel looked it up). The kernel then walks the path again with
    /// `LOOKUP_REVAL`, whose lookup finds the new file under a new node, and opens
    /// that: so an open after another client's replacing close gets a descriptor
    /// whose `fstat`, reads and writes are all of the new file.
    fn check_same_file(&self, ino: u64, path: &str, fresh: &Attr) -> Result<(), OpError> {
        let key = lock(&self.nodes).key(ino);
        match key {
            Some(k) if k != (fresh.dev, fresh.ino) => {
                lock(&self.nodes).store_attr(path, fresh.clone(), Instant::now());
                Err(OpError::new(
                    Errno::ESTALE,
                    format!("{path}: replaced on the server since it was looked up"),
                ))
            }
            _ => Ok(()),
        }
    }

    /// Close-to-open at an open of node `ino`: `fresh` is what the server said at this
    /// open, `before` what this mount last knew (and may have told the kernel). When
    /// the file changed in between (or this mount knew nothing), the kernel is told to
    /// drop its cached attributes, so its size (what an `O_APPEND` write and a read's
    /// end of file go by) and times are asked for again, and answered with `fresh`.
    /// Its page cache is the open reply's business (`FOPEN_KEEP_CACHE` only for an
    /// unchanged version).
    fn revalidated(&self, ino: u64, before: Option<&Attr>, fresh: &Attr) {
        let same = before.is_some_and(|b| {
            (b.size, b.mtime, b.ctime, b.ino) == (fresh.size, fresh.mtime, fresh.ctime, fresh.ino)
        });
        if same {
            return;
        }
        if let Some(n) = self.notifier.get() {
            // Attributes only (offset -1): no page is touched, so this cannot wait on
            // a page lock the kernel holds for the request being answered.
            if let Err(e) = n.inval_inode(INodeNo(ino), -1, 0) {
                tracing::debug!(ino, "cannot drop the kernel's cached attributes: {e}");
            }
        }
    }

    async fn create(
        &self,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        flags: i32,
    ) -> Result<(u64, u64, Attr), OpError> {
        if !self.writable {
            return Err(read_only());
        }
        let path = self.child(parent, name)?;
        let sp = self.share_path(&path);
        let share = self.share.clone();
        let label = format!("{share}/{sp}");
        let how = WriteOpen {
            create: Some(mode & 0o7777),
            exclusive: flags & nix::libc::O_EXCL != 0,
            truncate: flags & nix::libc::O_TRUNC != 0,
        };
        let _one = self.open_lock.lock().await;
        if how.exclusive || how.truncate {
            let conn = self.remote.conn().await?;
            if conn.client.has_finish() {
                let algorithm = conn
                    .client
                    .share_hash(&share)
                    .await
                    .map_err(|e| OpError::new(errno_of(&e), format!("create {label}: {e}")))?;
                return self.create_deferred(conn, path, how, algorithm);
            }
        }
        let (conn, opened, algorithm) = self
            .remote
            .call(&format!("create {label}"), |c| async move {
                let a = c.client.share_hash(&share).await?;
                let o = c
                    .client
                    .file_open(&share, &sp, how.create, how.exclusive, how.truncate)
                    .await?;
                Ok((c, o, a))
            })
            .await?;
        let attr = opened.attr.clone();
        if let Some(o) = self.created_owner(parent_of(&path)) {
            self.remember_owner(&attr, o);
        }
        let staged = opened.staged;
        let ino = lock(&self.nodes).remember(&path, (attr.dev, attr.ino));
        let wf = WriteFile::new(self.remote.clone(), conn, label, opened, algorithm)?;
        lock(&self.wfiles).insert(ino, wf.clone());
        if staged {
            lock(&self.staged).insert(path.clone(), (ino, wf.clone()));
        }
        {
            let mut nodes = lock(&self.nodes);
            nodes.changed(&path);
            nodes.changed(parent_of(&path));
        }
        let fh = self.next_fh.fetch_add(1, Ordering::Relaxed);
        lock(&self.wfhs).insert(fh, (ino, wf));
        Ok((ino, fh, attr))
    }

    /// The owner a file the current caller creates in `dir` gets from the server's
    /// kernel: the caller's uid, and the directory's group where it is set-group-ID,
    /// else the caller's; shown until the file's attributes are fetched again. `None`
    /// without a caller or where owners are not shown.
    fn created_owner(&self, dir: &str) -> Option<ferry_common::msg::Owner> {
        let caller = ferry_client::posix::current_caller().filter(|_| self.show_owners)?;
        let parent = lock(&self.nodes).attr(dir, Instant::now(), Duration::MAX);
        let inherited = parent
            .filter(|p| p.mode & 0o2000 != 0)
            .and_then(|p| lock(&self.owners).get(&(p.dev, p.ino)).map(|o| o.gid));
        Some(ferry_common::msg::Owner {
            uid: caller.uid,
            gid: inherited.unwrap_or(caller.gid),
        })
    }

    /// A file created `O_EXCL` or `O_TRUNC`, which nobody else can see before it takes
    /// its name: nothing is asked of the server now. Its close sends it whole (see
    /// `writer::Opened`); until then it has a provisional key, so its node a synthetic
    /// id, which [`Inner::settled`] ties to the server's file once it has a name.
    fn create_deferred(
        &self,
        conn: Arc<crate::remote::Conn>,
        path: String,
        how: WriteOpen,
        algorithm: HashAlgorithm,
    ) -> Result<(u64, u64, Attr), OpError> {
        let now = Timestamp::from_system(SystemTime::now());
        let (dev, ino) = lock(&self.nodes).provisional_key();
        let attr = Attr {
            kind: FileKind::File,
            size: 0,
            mode: how.create.unwrap_or(0o644),
            mtime: now,
            symlink_target: None,
            ino,
            nlink: 1,
            atime: now,
            ctime: now,
            blocks: 0,
            dev,
        };
        let create = crate::writer::Create {
            share: self.share.clone(),
            path: self.share_path(&path),
            mode: how.create.unwrap_or(0o644),
            exclusive: how.exclusive,
            caller: ferry_client::posix::current_caller(),
        };
        if let Some(o) = self.created_owner(parent_of(&path)) {
            self.remember_owner(&attr, o);
        }
        let wf = WriteFile::deferred(self.remote.clone(), conn, create, attr.clone(), algorithm)?;
        let id = {
            let mut nodes = lock(&self.nodes);
            let id = nodes.remember(&path, (dev, ino));
            nodes.changed(&path);
            nodes.changed(parent_of(&path));
            id
        };
        lock(&self.wfiles).insert(id, wf.clone());
        lock(&self.staged).insert(path, (id, wf.clone()));
        let fh = self.next_fh.fetch_add(1, Ordering::Relaxed);
        lock(&self.wfhs).insert(fh, (id, wf));
        Ok((id, fh, attr))
    }

    /// The last descriptor of a written node is gone: the server handle is closed (a
    /// staged file takes its name, if no `flush` gave it one).
    async fn release_write(&self, ino: u64, wf: Arc<WriteFile>) {
        if !wf.drop_ref() {
            return;
        }
        {
            let mut files = lock(&self.wfiles);
            if files.get(&ino).is_some_and(|f| Arc::ptr_eq(f, &wf)) {
                files.remove(&ino);
            }
        }
        let closed = wf.close().await;
        let path = self.path_of(INodeNo(ino)).ok();
        match closed {
            Ok(attr) => {
                if let Some(p) = &path {
                    self.settled(ino, p, &attr);
                }
            }
            Err(e) => {
                tracing::warn!("close: {}", e.message);
                lock(&self.staged).retain(|_, (_, f)| !Arc::ptr_eq(f, &wf));
                self.bump(ino);
            }
        }
    }

    async fn setattr(
        &self,
        ino: INodeNo,
        attrs: ferry_common::msg::SetAttrs,
    ) -> Result<Attr, OpError> {
        if !self.writable {
            return Err(read_only());
        }
        let path = self.path_of(ino)?;
        let attr = if let Some(wf) = self.wfile(ino.0) {
            wf.set_attr(attrs).await?
        } else if attrs.size.is_some() {
            // A size change with no descriptor open (truncate(2)): through a handle
            // opened for it, in place.
            let how = WriteOpen {
                create: None,
                exclusive: false,
                truncate: false,
            };
            let (fh, _) = self.open_write(ino.0, &path, how).await?;
            let wf = lock(&self.wfhs).remove(&fh).map(|(_, wf)| wf);
            let got = match &wf {
                Some(wf) => wf.set_attr(attrs).await,
                None => Err(OpError::new(Errno::EIO, "descriptor vanished")),
            };
            if let Some(wf) = wf {
                self.release_write(ino.0, wf).await;
            }
            got?
        } else {
            let sp = self.share_path(&path);
            let share = self.share.clone();
            self.remote
                .call(&format!("setattr {share}/{sp}"), |c| async move {
                    c.client.set_attrs(&share, &sp, attrs).await
                })
                .await?
        };
        lock(&self.nodes).store_attr(&path, attr.clone(), Instant::now());
        if attrs.size.is_some() {
            self.bump(ino.0);
        }
        if attrs.uid.is_some() || attrs.gid.is_some() {
            let known = lock(&self.owners).get(&(attr.dev, attr.ino)).copied();
            let was = known.unwrap_or(ferry_common::msg::Owner {
                uid: self.uid,
                gid: self.gid,
            });
            self.remember_owner(
                &attr,
                ferry_common::msg::Owner {
                    uid: attrs.uid.unwrap_or(was.uid),
                    gid: attrs.gid.unwrap_or(was.gid),
                },
            );
        }
        Ok(attr)
    }

    /// `setattr`: on a `posix` session, times go by `SetTimes` (the server's now for
    /// `UTIME_NOW`, whose permission rule differs from a given time's) after the rest,
    /// unless the file is open for writing here and not yet named on the server;
    /// else as [`Inner::setattr`].
    async fn setattr_posix(
        &self,
        ino: INodeNo,
        mut attrs: ferry_common::msg::SetAttrs,
        (atime, mtime): (TimeSet, TimeSet),
    ) -> Result<Attr, OpError> {
        let times = (atime, mtime) != (TimeSet::Omit, TimeSet::Omit);
        let posix = self.remote.conn().await?.client.has_posix();
        if !times || !posix {
            return self.setattr(ino, attrs).await;
        }
        // A descriptor open for writing here: its cached bytes land first, and its
        // view (what `getattr` answers while it is open) takes the new times after.
        let wf = self.wfile(ino.0);
        if let Some(wf) = &wf {
            if !wf.ready_for_times().await? {
                return self.setattr(ino, attrs).await;
            }
        }
        let all = attrs;
        (attrs.atime, attrs.mtime) = (None, None);
        if !attrs.is_empty() {
            self.setattr(ino, attrs).await?;
        }
        let path = self.path_of(ino)?;
        let sp = self.share_path(&path);
        let got = self
            .change(format!("utimens {sp}"), |c, share| async move {
                c.client.set_times(&share, &sp, atime, mtime).await
            })
            .await;
        let attr = match got {
            // A file this mount has not named yet is its creator's: its times go with
            // its handle.
            Err(e) if e.errno == Errno::ENOENT && self.wfile(ino.0).is_some() => {
                let times = ferry_common::msg::SetAttrs {
                    atime: all.atime,
                    mtime: all.mtime,
                    ..Default::default()
                };
                return self.setattr(ino, times).await;
            }
            got => got?,
        };
        if let Some(wf) = &wf {
            wf.times_set(&attr);
        }
        lock(&self.nodes).store_attr(&path, attr.clone(), Instant::now());
        Ok(attr)
    }

    /// Forgets the cached attributes of every name of the inode of `attr` (its link
    /// count or ctime changed by a link, unlink or rename of one of them).
    fn inode_changed(&self, attr: &Attr) {
        if attr.kind != FileKind::Dir {
            lock(&self.nodes).changed_inode(attr.dev, attr.ino);
        }
    }

    /// Runs a namespace change on the server: `what` for messages, `f` the call.
    async fn change<T, F, Fut>(&self, what: String, f: F) -> Result<T, OpError>
    where
        F: FnOnce(Arc<crate::remote::Conn>, String) -> Fut,
        Fut: std::future::Future<Output = Result<T, ferry_client::ClientError>>,
    {
        if !self.writable {
            return Err(read_only());
        }
        let share = self.share.clone();
        self.remote
            .call(&what, |c| async move { f(c, share).await })
            .await
    }

    /// The attributes of a name just made, as an entry for the kernel.
    async fn made(&self, path: &str) -> Result<(u64, Attr), OpError> {
        {
            let mut nodes = lock(&self.nodes);
            nodes.changed(path);
            nodes.changed(parent_of(path));
        }
        let attr = self.attr(path, Duration::ZERO).await?;
        let ino = lock(&self.nodes).remember(path, (attr.dev, attr.ino));
        Ok((ino, attr))
    }

    fn child(&self, parent: INodeNo, name: &OsStr) -> Result<String, OpError> {
        let name = name
            .to_str()
            .ok_or_else(|| OpError::new(Errno::EINVAL, "name is not UTF-8"))?;
        check_name_len(name)?;
        let path = join(&self.path_of(parent)?, name);
        // A path the protocol cannot carry is refused here, at once, for every call
        // that names a child (a deferred create would otherwise fail only at close).
        if self.share_path(&path).len() > MAX_PATH_BYTES {
            return Err(OpError::new(
                Errno::ENAMETOOLONG,
                format!("{name}: the path from the share's root exceeds {MAX_PATH_BYTES} bytes"),
            ));
        }
        Ok(path)
    }

    /// Whether `path` in directory `dir` is missing by [`Inner::fresh_dirs`]: `dir` was
    /// made by this mount less than `negative_timeout` ago and `path` is no node and
    /// has no cached attributes.
    fn fresh_and_unknown(&self, dir: &str, path: &str) -> bool {
        let now = Instant::now();
        let fresh = {
            let mut dirs = lock(&self.fresh_dirs);
            dirs.retain(|_, at| now.saturating_duration_since(*at) < self.opts.negative_ttl);
            dirs.contains_key(dir)
        };
        if !fresh {
            return false;
        }
        let nodes = lock(&self.nodes);
        nodes.id_of(path).is_none() && nodes.attr(path, now, Duration::MAX).is_none()
    }

    async fn mkdir(
        &self,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
    ) -> Result<(u64, Attr), OpError> {
        let path = self.child(parent, name)?;
        let sp = self.share_path(&path);
        self.change(format!("mkdir {sp}"), |c, share| async move {
            c.client.mkdir(&share, &sp, mode & 0o7777, false).await
        })
        .await?;
        let made = self.made(&path).await?;
        if !self.opts.negative_ttl.is_zero() {
            lock(&self.fresh_dirs).insert(path, Instant::now());
        }
        Ok(made)
    }

    /// `mknod` of a FIFO, socket or device node (a `posix` session's `MakeNode`).
    async fn make_node(
        &self,
        parent: INodeNo,
        name: &OsStr,
        kind: NodeKind,
        mode: u32,
        rdev: u64,
    ) -> Result<(u64, Attr), OpError> {
        let path = self.child(parent, name)?;
        let sp = self.share_path(&path);
        let (attr, owner) = self
            .change(format!("mknod {sp}"), |c, share| async move {
                c.client.make_node(&share, &sp, kind, mode, rdev).await
            })
            .await?;
        self.remember_owner(&attr, owner);
        let made = self.made(&path).await?;
        Ok(made)
    }

    async fn symlink(
        &self,
        parent: INodeNo,
        name: &OsStr,
        target: &Path,
    ) -> Result<(u64, Attr), OpError> {
        let path = self.child(parent, name)?;
        let target = target
            .to_str()
            .ok_or_else(|| OpError::new(Errno::EINVAL, "symlink target is not UTF-8"))?
            .to_string();
        let sp = self.share_path(&path);
        self.change(format!("symlink {sp}"), |c, share| async move {
            c.client.symlink(&share, &sp, &target).await
        })
        .await?;
        self.made(&path).await
    }

    async fn link(
        &self,
        ino: INodeNo,
        newparent: INodeNo,
        newname: &OsStr,
    ) -> Result<(u64, Attr), OpError> {
        let from = self.path_of(ino)?;
        self.name_staged(&from).await?;
        let to = self.child(newparent, newname)?;
        let (sf, st) = (self.share_path(&from), self.share_path(&to));
        self.change(format!("link {sf} to {st}"), |c, share| async move {
            c.client.link(&share, &sf, &st).await
        })
        .await?;
        lock(&self.nodes).changed(&from);
        let made = self.made(&to).await?;
        self.inode_changed(&made.1);
        Ok(made)
    }

    /// unlink (`dir` false) or rmdir (`dir` true).
    async fn remove(&self, parent: INodeNo, name: &OsStr, dir: bool) -> Result<(), OpError> {
        let path = self.child(parent, name)?;
        self.name_staged(&path).await?;
        let attr = self.attr(&path, Duration::ZERO).await?;
        match (dir, attr.kind == FileKind::Dir) {
            (false, true) => {
                return Err(OpError::new(
                    Errno::EISDIR,
                    format!("{path}: is a directory"),
                ))
            }
            (true, false) => {
                return Err(OpError::new(
                    Errno::ENOTDIR,
                    format!("{path}: not a directory"),
                ))
            }
            _ => {}
        }
        let sp = self.share_path(&path);
        let got = self
            .change(format!("remove {sp}"), |c, share| async move {
                c.client.remove(&share, &sp, false).await
            })
            .await;
        match got {
            // `Remove` reports a directory that is not empty as existing.
            Err(e) if dir && e.errno == Errno::EEXIST => {
                Err(OpError::new(Errno::ENOTEMPTY, e.message))
            }
            Err(e) => Err(e),
            Ok(()) => {
                self.inode_changed(&attr);
                let mut nodes = lock(&self.nodes);
                nodes.removed(&path, Instant::now());
                nodes.changed(parent_of(&path));
                Ok(())
            }
        }
    }

    async fn rename(
        &self,
        parent: INodeNo,
        name: &OsStr,
        newparent: INodeNo,
        newname: &OsStr,
        flags: fuser::RenameFlags,
    ) -> Result<(), OpError> {
        if flags.contains(fuser::RenameFlags::RENAME_EXCHANGE)
            || flags.contains(fuser::RenameFlags::RENAME_WHITEOUT)
        {
            return Err(OpError::new(
                Errno::EINVAL,
                "rename: only RENAME_NOREPLACE is supported",
            ));
        }
        let from = self.child(parent, name)?;
        let to = self.child(newparent, newname)?;
        self.name_staged(&from).await?;
        self.name_staged(&to).await?;
        let no_replace = flags.contains(fuser::RenameFlags::RENAME_NOREPLACE);
        // The moved inode's ctime changes, and a replaced one loses a link.
        let before: Vec<Attr> = {
            let nodes = lock(&self.nodes);
            [&from, &to]
                .iter()
                .filter_map(|p| nodes.attr(p, Instant::now(), Duration::MAX))
                .collect()
        };
        let (sf, st) = (self.share_path(&from), self.share_path(&to));
        self.change(format!("rename {sf} to {st}"), |c, share| async move {
            c.client.move_entry(&share, &sf, &st, no_replace).await
        })
        .await?;
        before.iter().for_each(|a| self.inode_changed(a));
        let mut nodes = lock(&self.nodes);
        nodes.renamed(&from, &to, Instant::now());
        nodes.changed(parent_of(&from));
        nodes.changed(parent_of(&to));
        Ok(())
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

impl Inner {
    /// Asks the kernel to forward `fcntl` locks and `flock` when the server holds
    /// locks (the `locks` capability); otherwise the kernel keeps them local to this
    /// mount, as before.
    fn enable_locks(&self, config: &mut KernelConfig) {
        if !self.remote.current().is_some_and(|c| c.client.has_locks()) {
            tracing::warn!(
                "the server does not hold locks: flock and fcntl locks stay local to this mount"
            );
            return;
        }
        let flags = fuser::InitFlags::FUSE_POSIX_LOCKS | fuser::InitFlags::FUSE_FLOCK_LOCKS;
        if let Err(missing) = config.add_capabilities(flags) {
            tracing::warn!("the kernel lacks {missing:?}: those locks stay local to this mount");
        }
    }

    /// Where this mount's locks are held: the server, per connection.
    fn lock_backend(&self) -> ServerLocks<'_> {
        ServerLocks {
            remote: &self.remote,
            share: &self.share,
        }
    }

    /// Whether descriptor `fh` lost its locks to a reconnection (see [`crate::locks`]).
    fn lock_lost(&self, fh: u64) -> bool {
        self.locks.lost(fh, || self.lock_backend().current())
    }

    /// `F_SETLK` (`waiter`: `F_SETLKW` by that thread). A lock taken makes the file's
    /// bytes as the server has them what this mount shows (close-to-open at the lock,
    /// as NFS does); what this mount wrote goes back before a lock is dropped.
    async fn set_lock(&self, ask: LockAsk, waiter: Option<u32>) -> Result<(), OpError> {
        if self.lock_lost(ask.fh) {
            return Err(OpError::new(
                Errno::EIO,
                "its locks were lost to a reconnection",
            ));
        }
        let path = self.lock_path(ask.ino).await?;
        let wf = self.wfile(ask.ino);
        if ask.kind == ferry_common::locks::LockKind::Unlock {
            if let Some(wf) = &wf {
                wf.write_back().await?;
            }
        }
        self.locks
            .set(&self.lock_backend(), &path, ask, waiter)
            .await?;
        if ask.kind != ferry_common::locks::LockKind::Unlock {
            if let Some(wf) = &wf {
                wf.revalidate().await?;
            }
            // Read descriptors map the file again; the kernel drops its cached pages
            // and attributes of it. Dropping pages waits for reads in flight on them,
            // which tasks of this runtime answer: off its worker threads.
            self.bump(ask.ino);
            if let Some(n) = self.notifier.get().cloned() {
                let ino = ask.ino;
                let dropped =
                    tokio::task::spawn_blocking(move || n.inval_inode(INodeNo(ino), 0, 0)).await;
                if let Ok(Err(e)) = dropped {
                    tracing::debug!(ino, "cannot drop the kernel's cache: {e}");
                }
            }
        }
        Ok(())
    }

    /// `F_GETLK`: the lock in the way of `ask`, if any.
    async fn test_lock(
        &self,
        ask: LockAsk,
    ) -> Result<Option<ferry_common::locks::LockHeld>, OpError> {
        if self.lock_lost(ask.fh) {
            return Err(OpError::new(
                Errno::EIO,
                "its locks were lost to a reconnection",
            ));
        }
        let path = self.lock_path(ask.ino).await?;
        self.locks.test(&self.lock_backend(), &path, ask).await
    }

    /// The share path of node `ino` for a lock request: a file created through this
    /// mount that has not taken its name on the server takes it now (the server finds
    /// the file to lock by its name, and other clients that lock it must see it).
    async fn lock_path(&self, ino: u64) -> Result<String, OpError> {
        let path = self.path_of(INodeNo(ino))?;
        self.name_staged(&path).await?;
        Ok(self.share_path(&path))
    }
}

/// Logs a failed operation at a level that fits its errno, and returns the errno.
fn fail(op: &str, e: OpError) -> Errno {
    // A missing name, and a node whose name another client replaced (the kernel
    // looks it up again), are the normal course of things.
    if e.errno == Errno::ENOENT || e.errno == Errno::ESTALE {
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
        // Writes of up to 1 MiB per request; O_TRUNC reaches `open` (not a separate
        // size change before it), so a truncating open is staged like a new file.
        let _ = config.set_max_write(1 << 20);
        if let Err(missing) = config.add_capabilities(fuser::InitFlags::FUSE_ATOMIC_O_TRUNC) {
            tracing::warn!("the kernel lacks {missing:?}: O_TRUNC truncates in place");
        }
        self.inner.enable_locks(config);
        Ok(())
    }

    fn lookup(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEntry) {
        let name = name.to_owned();
        self.run(|fs| async move {
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

    fn getattr(&self, _req: &Request, ino: INodeNo, fh: Option<FileHandle>, reply: ReplyAttr) {
        if let Some(wf) = self.inner.wfile(ino.0) {
            let a = wf.attr();
            return reply.attr(&Duration::ZERO, &self.inner.file_attr(ino.0, &a));
        }
        // fstat of a read descriptor: the version it reads (its name may hold another
        // file by now).
        let open = fh.and_then(|fh| lock(&self.inner.files).get(&fh.0).cloned());
        if let Some(file) = open {
            return reply.attr(
                &self.inner.opts.attr_ttl,
                &self.inner.file_attr(ino.0, &file.attr()),
            );
        }
        self.spawn(|fs| async move {
            let got = match fs.path_of(ino) {
                Ok(path) => fs.attr(&path, fs.opts.attr_ttl).await,
                Err(e) => Err(e),
            };
            // The node's name now holds another file (replaced by a rename): this node
            // is stale, and the kernel looks the name up again.
            let key = lock(&fs.nodes).key(ino.0);
            let got = match got {
                Ok(a) if key.is_some_and(|k| k != (a.dev, a.ino)) => Err(OpError::new(
                    Errno::ESTALE,
                    format!("inode {}: its name now holds another file", ino.0),
                )),
                other => other,
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

    fn open(&self, req: &Request, ino: INodeNo, flags: OpenFlags, reply: ReplyOpen) {
        let acc = flags.0 & nix::libc::O_ACCMODE;
        let writing = self.inner.wfile(ino.0).is_some();
        // A reader of a node open for writing on this mount shares its handle: the
        // file may not have its name on the server yet, and it must see those writes.
        if acc != nix::libc::O_RDONLY || flags.0 & nix::libc::O_TRUNC != 0 || writing {
            let how = WriteOpen {
                create: None,
                exclusive: false,
                truncate: flags.0 & nix::libc::O_TRUNC != 0,
            };
            let opener = Some(req.pid());
            self.spawn_as(req, |fs| async move {
                let got = match fs.path_of(ino) {
                    Ok(path) => fs.open_write(ino.0, &path, how).await,
                    Err(e) => Err(e),
                };
                match got {
                    Ok((fh, _)) => {
                        if let Some(tid) = opener {
                            lock(&fs.openers).insert(fh, tid);
                        }
                        reply.opened(FileHandle(fh), write_open_flags(flags.0))
                    }
                    Err(e) => reply.error(fail("open", e)),
                }
            });
            return;
        }
        self.spawn_as(req, |fs| async move {
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
        ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        size: u32,
        _flags: OpenFlags,
        _lock_owner: Option<fuser::LockOwner>,
        reply: ReplyData,
    ) {
        if self.inner.lock_lost(fh.0) {
            return reply.error(Errno::EIO);
        }
        // A node open for writing on this mount is read through its handle, after its
        // cached writes went back.
        if let Some(wf) = self.inner.wfile(ino.0) {
            self.spawn(|_| async move {
                match wf.read(offset, size).await {
                    Ok(data) => reply.data(&data),
                    Err(e) => reply.error(fail("read", e)),
                }
            });
            return;
        }
        let stale = lock(&self.inner.read_gens)
            .get(&fh.0)
            .is_some_and(|&(node, gen)| gen != self.inner.gen_of(node));
        if stale {
            // Written through this mount since this descriptor mapped it: map again.
            self.spawn(|fs| async move {
                let got = match fs.reopen(ino, fh.0).await {
                    Ok(file) => file.read(&fs.reader, offset, size).await,
                    Err(e) => Err(e),
                };
                answer_read(&fs.reader, reply, got);
            });
            return;
        }
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
            self.spawn(
                |fs| async move { fs.locks.release(&fs.lock_backend(), ino.0, owner.0).await },
            );
        }
        lock(&self.inner.read_gens).remove(&fh.0);
        if let Some(file) = lock(&self.inner.files).remove(&fh.0) {
            let _guard = self.rt.enter();
            file.release();
        }
        lock(&self.inner.openers).remove(&fh.0);
        let written = lock(&self.inner.wfhs).remove(&fh.0);
        if let Some((ino, wf)) = written {
            // Errors were reported by `flush` (close); what is left is logged.
            self.spawn(|fs| async move { fs.release_write(ino, wf).await });
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
                        let kind = file_type(e.attr.kind);
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
        req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        lock_owner: fuser::LockOwner,
        reply: ReplyEmpty,
    ) {
        let Some((ino, wf)) = lock(&self.inner.wfhs).get(&fh.0).cloned() else {
            // A read descriptor: nothing to write back; the closing owner's record
            // locks on the file go (POSIX: any close by the owner drops them).
            if !self.inner.locks.holds(ino.0, lock_owner.0) {
                return reply.ok();
            }
            return self.spawn(|fs| async move {
                fs.locks
                    .release(&fs.lock_backend(), ino.0, lock_owner.0)
                    .await;
                reply.ok()
            });
        };
        let opener = lock(&self.inner.openers).get(&fh.0).copied();
        let by_opener = opener.is_some_and(|tid| same_process(tid, req.pid()))
            && !self.inner.holds_another(req.pid(), ino);
        // close(2) by the opener, its last descriptor of the file: written back,
        // durable and named (close-to-open); by another process, or by the opener
        // still holding another descriptor (a `dup`): written back. Errors reach close
        // either way.
        self.run(|fs| async move {
            let got = if by_opener {
                wf.flush(fs.opts.sync_close).await
            } else {
                wf.write_back().await
            };
            // Written back first: the next holder of the lock reads these bytes.
            fs.locks
                .release(&fs.lock_backend(), ino, lock_owner.0)
                .await;
            fs.answer_sync(ino, got, "close", reply);
        });
    }

    fn fsync(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        datasync: bool,
        reply: ReplyEmpty,
    ) {
        let Some((ino, wf)) = lock(&self.inner.wfhs).get(&fh.0).cloned() else {
            return reply.ok();
        };
        self.spawn(|fs| async move {
            let got = wf.sync(datasync).await;
            fs.answer_sync(ino, got, "fsync", reply);
        });
    }

    fn fsyncdir(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _fh: FileHandle,
        _datasync: bool,
        reply: ReplyEmpty,
    ) {
        // The server makes every directory change durable before answering it.
        reply.ok();
    }

    fn fallocate(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        length: u64,
        mode: i32,
        reply: ReplyEmpty,
    ) {
        let Some(how) = crate::writer::Allocation::of_mode(mode) else {
            return reply.error(Errno::EOPNOTSUPP);
        };
        let Some((ino, wf)) = lock(&self.inner.wfhs).get(&fh.0).cloned() else {
            return reply.error(Errno::EBADF);
        };
        self.spawn(|fs| async move {
            match wf.allocate(offset, length, how).await {
                Ok(_) => {
                    fs.bump(ino);
                    reply.ok()
                }
                Err(e) => reply.error(fail("fallocate", e)),
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

    fn access(&self, _req: &Request, _ino: INodeNo, _mask: fuser::AccessFlags, reply: ReplyEmpty) {
        // Permission bits are the kernel's business (`default_permissions`) and the
        // server's, which checks every change against its own credentials.
        reply.ok();
    }

    fn getxattr(
        &self,
        _req: &Request,
        ino: INodeNo,
        name: &OsStr,
        size: u32,
        reply: fuser::ReplyXattr,
    ) {
        let name = name.to_owned();
        self.spawn(move |fs| async move {
            let got = fs.getxattr(ino, &name).await;
            xattr::answer_xattr("getxattr", reply, size, got);
        });
    }

    fn listxattr(&self, _req: &Request, ino: INodeNo, size: u32, reply: fuser::ReplyXattr) {
        self.spawn(move |fs| async move {
            let got = fs.listxattr(ino).await;
            xattr::answer_xattr("listxattr", reply, size, got);
        });
    }

    fn setxattr(
        &self,
        req: &Request,
        ino: INodeNo,
        name: &OsStr,
        value: &[u8],
        flags: i32,
        position: u32,
        reply: ReplyEmpty,
    ) {
        let mode = match xattr::set_mode(flags) {
            Ok(m) if position == 0 => m,
            Ok(_) => return reply.error(Errno::EINVAL),
            Err(e) => return reply.error(e),
        };
        let (name, value) = (name.to_owned(), value.to_vec());
        self.spawn_as(req, move |fs| async move {
            let got = fs.change_xattr(ino, &name, Some((value, mode))).await;
            xattr::answer_change("setxattr", reply, got);
        });
    }

    fn removexattr(&self, req: &Request, ino: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        let name = name.to_owned();
        self.spawn_as(req, move |fs| async move {
            let got = fs.change_xattr(ino, &name, None).await;
            xattr::answer_change("removexattr", reply, got);
        });
    }

    fn setattr(
        &self,
        req: &Request,
        ino: INodeNo,
        mode: Option<u32>,
        uid: Option<u32>,
        gid: Option<u32>,
        size: Option<u64>,
        atime: Option<fuser::TimeOrNow>,
        mtime: Option<fuser::TimeOrNow>,
        _ctime: Option<SystemTime>,
        _fh: Option<FileHandle>,
        _crtime: Option<SystemTime>,
        _chgtime: Option<SystemTime>,
        _bkuptime: Option<SystemTime>,
        _flags: Option<fuser::BsdFileFlags>,
        reply: ReplyAttr,
    ) {
        let attrs = ferry_common::msg::SetAttrs {
            size,
            mode: mode.map(|m| m & 0o7777),
            uid,
            gid,
            atime: atime.map(timestamp),
            mtime: mtime.map(timestamp),
        };
        let times = (time_set(atime), time_set(mtime));
        self.run_as(req, |fs| async move {
            match fs.setattr_posix(ino, attrs, times).await {
                Ok(a) => {
                    let a = fs.wfile(ino.0).map_or(a, |wf| wf.attr());
                    reply.attr(&Duration::ZERO, &fs.file_attr(ino.0, &a))
                }
                Err(e) => reply.error(fail("setattr", e)),
            }
        });
    }

    fn mknod(
        &self,
        req: &Request,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        umask: u32,
        rdev: u32,
        reply: ReplyEntry,
    ) {
        let node = match mode & nix::libc::S_IFMT {
            nix::libc::S_IFREG => None,
            nix::libc::S_IFIFO => Some(NodeKind::Fifo),
            nix::libc::S_IFSOCK => Some(NodeKind::Socket),
            nix::libc::S_IFCHR => Some(NodeKind::Char),
            nix::libc::S_IFBLK => Some(NodeKind::Block),
            _ => return reply.error(Errno::EINVAL),
        };
        let name = name.to_owned();
        if let Some(kind) = node {
            let mode = mode & !umask & 0o7777;
            return self.spawn_as(req, |fs| async move {
                match fs
                    .make_node(parent, &name, kind, mode, u64::from(rdev))
                    .await
                {
                    Ok((ino, attr)) => {
                        reply.entry(&fs.opts.entry_ttl, &fs.file_attr(ino, &attr), Generation(0))
                    }
                    Err(e) => reply.error(fail("mknod", e)),
                }
            });
        }
        self.spawn_as(req, |fs| async move {
            let made = async {
                let flags = nix::libc::O_EXCL;
                let (ino, fh, _) = fs.create(parent, &name, mode & !umask, flags).await?;
                let wf = lock(&fs.wfhs).remove(&fh).map(|(_, wf)| wf);
                if let Some(wf) = wf {
                    fs.release_write(ino, wf).await;
                }
                let path = fs.child(parent, &name)?;
                fs.made(&path).await
            };
            match made.await {
                Ok((ino, attr)) => {
                    reply.entry(&fs.opts.entry_ttl, &fs.file_attr(ino, &attr), Generation(0))
                }
                Err(e) => reply.error(fail("mknod", e)),
            }
        });
    }

    fn mkdir(
        &self,
        req: &Request,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        umask: u32,
        reply: ReplyEntry,
    ) {
        let name = name.to_owned();
        self.spawn_as(req, |fs| async move {
            match fs.mkdir(parent, &name, mode & !umask).await {
                Ok((ino, attr)) => {
                    reply.entry(&fs.opts.entry_ttl, &fs.file_attr(ino, &attr), Generation(0))
                }
                Err(e) => reply.error(fail("mkdir", e)),
            }
        });
    }

    fn unlink(&self, req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        let name = name.to_owned();
        self.spawn_as(req, |fs| async move {
            match fs.remove(parent, &name, false).await {
                Ok(()) => reply.ok(),
                Err(e) => reply.error(fail("unlink", e)),
            }
        });
    }

    fn rmdir(&self, req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        let name = name.to_owned();
        self.spawn_as(req, |fs| async move {
            match fs.remove(parent, &name, true).await {
                Ok(()) => reply.ok(),
                Err(e) => reply.error(fail("rmdir", e)),
            }
        });
    }

    fn symlink(
        &self,
        req: &Request,
        parent: INodeNo,
        link_name: &OsStr,
        target: &Path,
        reply: ReplyEntry,
    ) {
        let (name, target) = (link_name.to_owned(), target.to_owned());
        self.spawn_as(req, |fs| async move {
            match fs.symlink(parent, &name, &target).await {
                Ok((ino, attr)) => {
                    reply.entry(&fs.opts.entry_ttl, &fs.file_attr(ino, &attr), Generation(0))
                }
                Err(e) => reply.error(fail("symlink", e)),
            }
        });
    }

    fn rename(
        &self,
        req: &Request,
        parent: INodeNo,
        name: &OsStr,
        newparent: INodeNo,
        newname: &OsStr,
        flags: fuser::RenameFlags,
        reply: ReplyEmpty,
    ) {
        let (name, newname) = (name.to_owned(), newname.to_owned());
        self.spawn_as(req, |fs| async move {
            match fs.rename(parent, &name, newparent, &newname, flags).await {
                Ok(()) => reply.ok(),
                Err(e) => reply.error(fail("rename", e)),
            }
        });
    }

    fn link(
        &self,
        req: &Request,
        ino: INodeNo,
        newparent: INodeNo,
        newname: &OsStr,
        reply: ReplyEntry,
    ) {
        let newname = newname.to_owned();
        self.spawn_as(req, |fs| async move {
            match fs.link(ino, newparent, &newname).await {
                Ok((ino, attr)) => {
                    reply.entry(&fs.opts.entry_ttl, &fs.file_attr(ino, &attr), Generation(0))
                }
                Err(e) => reply.error(fail("link", e)),
            }
        });
    }

    fn write(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        data: &[u8],
        _write_flags: fuser::WriteFlags,
        flags: OpenFlags,
        _lock_owner: Option<fuser::LockOwner>,
        reply: fuser::ReplyWrite,
    ) {
        if self.inner.lock_lost(fh.0) {
            return reply.error(Errno::EIO);
        }
        let Some((_, wf)) = lock(&self.inner.wfhs).get(&fh.0).cloned() else {
            return reply.error(Errno::EBADF);
        };
        let len = data.len() as u32;
        // `O_APPEND` (the descriptor's flags as they are now): at the end of the file as
        // the server had it at this open plus this mount's writes since, not at the
        // kernel's offset, which comes from the size it cached before another client's
        // close.
        let append = flags.0 & nix::libc::O_APPEND != 0;
        // The bytes are copied into the write-back cache on this thread while another
        // stays free for the kernel; past that, on the runtime.
        if let Some(_held) = ThreadClaim::take(&self.inner.blocked_reads, self.inner.opts.threads) {
            return match self.rt.block_on(write_or_append(&wf, append, offset, data)) {
                Ok(()) => reply.written(len),
                Err(e) => reply.error(fail("write", e)),
            };
        }
        let data = data.to_vec();
        self.spawn(|_| async move {
            match write_or_append(&wf, append, offset, &data).await {
                Ok(()) => reply.written(len),
                Err(e) => reply.error(fail("write", e)),
            }
        });
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
        let name = name.to_owned();
        let opener = Some(req.pid());
        self.run_as(req, |fs| async move {
            match fs.create(parent, &name, mode & !umask, flags).await {
                Ok((ino, fh, attr)) => {
                    if let Some(tid) = opener {
                        lock(&fs.openers).insert(fh, tid);
                    }
                    // The size is the kernel's to track while it writes; other
                    // attributes come back from the server at close.
                    reply.created(
                        &fs.opts.entry_ttl,
                        &fs.file_attr(ino, &attr),
                        Generation(0),
                        FileHandle(fh),
                        write_open_flags(flags),
                    )
                }
                Err(e) => reply.error(fail("create", e)),
            }
        });
    }
}
