//! Early writeback and group commits.
//!
//! [`Writeback`]: flush a file being written in the background, so that the final
//! fsync before the rename has little left to do and the disk works while the network
//! does.
//!
//! [`sync_filesystems`]: making many files durable at once, one `syncfs(2)` per
//! filesystem that a group of files lives on, the group commit a receiver of a batch
//! of small files uses. The `syncfs` calls of one process are shared ([`GroupSync`]):
//! a caller that needs its filesystem flushed waits for the next `syncfs` that starts
//! after it asked, and whichever caller finds none running starts it for all who wait.
//! So concurrent commits (a batch, a file on the per-file path, from any connection)
//! pay one flush between them, not one each: on a journaled ext4 each flush is a
//! journal commit and a flush of the device's cache, and per-file fsyncs, one for the
//! file and one for its directory, were most of the time of a tree of files over the
//! batch threshold (docs/performance.md, "Mixed trees").
//!
//! Why not the writeback of each file started (`sync_file_range`) and then an fsync
//! of each, as before: on ext4 every `fsync` of a file issues its own flush of
//! the device's cache (on these VMs a flush of the host's image file), even when the
//! first fsync's journal commit already carried the others' metadata; 256 fsyncs are
//! 256 flushes. `bench/floor.py` (10,000 files of 4 KiB in batches of 256, Python,
//! no network) measured 283 files/s with writeback started then fsync per file, and
//! 2,278 files/s with a `syncfs` before the renames and one after, the same crash
//! guarantee. The cost is that a `syncfs` also writes back whatever else is dirty on
//! that filesystem; ferryd's own big files bypass the page cache
//! ([`crate::direct`]), so on a file server that is mostly the batch itself.
//!
//! Invariant: an error from a background flush is kept and returned by
//! [`Writeback::finish`]. (Linux reports a writeback error to one fsync per open file
//! only, so a background flush that swallowed it would let the final fsync succeed on
//! lost data.)

use std::collections::HashMap;
use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::MetadataExt;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock};

/// Bytes written between background flushes.
pub const WRITEBACK_STEP_BYTES: u64 = 64 << 20;

/// Background flushing of one file.
pub struct Writeback {
    file: Arc<File>,
    unflushed: AtomicU64,
    busy: Arc<AtomicBool>,
    error: Arc<Mutex<Option<std::io::Error>>>,
}

impl Writeback {
    /// Tracks writes to `file`.
    pub fn new(file: Arc<File>) -> Writeback {
        Writeback {
            file,
            unflushed: AtomicU64::new(0),
            busy: Arc::new(AtomicBool::new(false)),
            error: Arc::new(Mutex::new(None)),
        }
    }

    /// Records `bytes` written; every [`WRITEBACK_STEP_BYTES`] starts an `fdatasync` on
    /// a blocking thread unless one is running. Must be called inside a tokio runtime.
    pub fn wrote(&self, bytes: u64) {
        let total = self.unflushed.fetch_add(bytes, Ordering::SeqCst) + bytes;
        if total < WRITEBACK_STEP_BYTES || self.busy.swap(true, Ordering::SeqCst) {
            return;
        }
        self.unflushed.store(0, Ordering::SeqCst);
        let (file, busy, error) = (self.file.clone(), self.busy.clone(), self.error.clone());
        tokio::task::spawn_blocking(move || {
            if let Err(e) = file.sync_data() {
                error
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .get_or_insert(e);
            }
            busy.store(false, Ordering::SeqCst);
        });
    }

    /// Fsyncs the file (data and metadata) and returns the first error of any flush.
    /// Blocking.
    pub fn finish(&self) -> std::io::Result<()> {
        let synced = self.file.sync_all();
        self.take_error()?;
        synced
    }

    /// Makes the file durable with the other commits of its filesystem: one shared
    /// `syncfs` ([`sync_filesystem`]) instead of an fsync of its own. Returns the first
    /// error of any flush. Blocking.
    pub fn finish_grouped(&self) -> std::io::Result<()> {
        let synced = sync_filesystem(&self.file);
        self.take_error()?;
        synced
    }

    /// The first error of a background flush since the last call, if any (a caller
    /// making the file durable by its own means reports it).
    pub fn take_error(&self) -> std::io::Result<()> {
        match self.error.lock().unwrap_or_else(|p| p.into_inner()).take() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }
}

/// Shared `syncfs` calls, per filesystem (by `st_dev`): the group commit of a process.
///
/// Invariant: [`GroupSync::sync`] returns only after a `syncfs` of the caller's
/// filesystem that *started* after the caller called it completed, so everything the
/// caller wrote before the call is covered; it returns an error if that flush, or any
/// later one of the same filesystem that completed before the caller woke, failed (a
/// writeback error cannot be pinned to one file, see [`sync_filesystems`]).
pub struct GroupSync {
    devs: Mutex<HashMap<u64, Arc<DevSync>>>,
    /// The flush: `syncfs(2)` (another function in tests).
    flush: fn(&File) -> nix::Result<()>,
}

impl Default for GroupSync {
    fn default() -> GroupSync {
        GroupSync {
            devs: Mutex::default(),
            flush: |file| nix::unistd::syncfs(file.as_raw_fd()),
        }
    }
}

/// The flushes of one filesystem: generations numbered from 1.
#[derive(Default)]
struct DevSync {
    state: Mutex<DevState>,
    done: Condvar,
}

#[derive(Default)]
struct DevState {
    /// The generation running or last started.
    started: u64,
    /// The last generation that completed (`finished <= started`).
    finished: u64,
    /// A `syncfs` is running (generation `started`).
    running: bool,
    /// The last generation that failed, and its errno.
    failed: Option<(u64, i32)>,
}

impl GroupSync {
    /// Flushes the filesystem `file` is on, sharing the `syncfs` with every concurrent
    /// caller of the same filesystem. Blocking.
    pub fn sync(&self, file: &File) -> io::Result<()> {
        let dev = file.metadata()?.dev();
        let slot = {
            let mut devs = self.devs.lock().unwrap_or_else(|p| p.into_inner());
            devs.entry(dev).or_default().clone()
        };
        let mut state = slot.state.lock().unwrap_or_else(|p| p.into_inner());
        // A flush running now may have started before this caller's writes: only the
        // next one is sure to cover them.
        let wanted = state.started + 1;
        loop {
            if state.finished >= wanted {
                return match state.failed {
                    Some((generation, errno)) if generation >= wanted => {
                        Err(io::Error::from_raw_os_error(errno))
                    }
                    _ => Ok(()),
                };
            }
            if !state.running {
                // Lead generation `wanted` (== started + 1: nothing started since).
                state.running = true;
                state.started = wanted;
                drop(state);
                let result = (self.flush)(file);
                state = slot.state.lock().unwrap_or_else(|p| p.into_inner());
                state.running = false;
                state.finished = wanted;
                if let Err(errno) = result {
                    state.failed = Some((wanted, errno as i32));
                }
                slot.done.notify_all();
                continue;
            }
            state = slot.done.wait(state).unwrap_or_else(|p| p.into_inner());
        }
    }
}

/// The process's [`GroupSync`].
fn group() -> &'static GroupSync {
    static GROUP: OnceLock<GroupSync> = OnceLock::new();
    GROUP.get_or_init(GroupSync::default)
}

/// Makes everything written to the filesystem `file` is on durable, with one `syncfs`
/// shared by every concurrent caller in this process ([`GroupSync`]). Blocking.
pub fn sync_filesystem(file: &File) -> io::Result<()> {
    group().sync(file)
}

/// Makes everything written to the filesystems that `files` live on durable: one
/// `syncfs` per distinct filesystem (by `st_dev`). Returns one result per file, in
/// order: the error of its filesystem's flush, or of its `fstat`. Since Linux 5.8
/// `syncfs` reports writeback errors of the filesystem; a failed flush fails every file
/// on that filesystem, since which one lost data cannot be told. Blocking.
pub fn sync_filesystems(files: &[&File]) -> Vec<io::Result<()>> {
    let devs: Vec<io::Result<u64>> = files
        .iter()
        .map(|f| f.metadata().map(|m| m.dev()))
        .collect();
    sync_devs(files, devs)
}

/// [`sync_filesystems`] for files whose filesystems the caller knows already: `devs`
/// holds the `st_dev` of each of `files`, in order (no `fstat` per file). Blocking.
pub fn sync_filesystems_on(files: &[&File], devs: &[u64]) -> Vec<io::Result<()>> {
    sync_devs(files, devs.iter().map(|d| Ok(*d)).collect())
}

fn sync_devs(files: &[&File], devs: Vec<io::Result<u64>>) -> Vec<io::Result<()>> {
    let mut flushed: HashMap<u64, Result<(), (io::ErrorKind, Option<i32>)>> = HashMap::new();
    for (file, dev) in files.iter().zip(&devs) {
        if let Ok(dev) = dev {
            flushed
                .entry(*dev)
                .or_insert_with(|| group().sync(file).map_err(|e| (e.kind(), e.raw_os_error())));
        }
    }
    devs.into_iter()
        .map(|dev| match flushed.get(&dev?) {
            Some(Err((_, Some(errno)))) => Err(io::Error::from_raw_os_error(*errno)),
            Some(Err((kind, None))) => Err(io::Error::from(*kind)),
            _ => Ok(()),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn flushes_in_the_background_and_finishes() {
        let mut f = tempfile::tempfile().unwrap();
        f.write_all(&vec![1u8; 1 << 20]).unwrap();
        let wb = Writeback::new(Arc::new(f));
        wb.wrote(WRITEBACK_STEP_BYTES);
        wb.finish().unwrap();
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_background_flush_error_is_reported_by_finish() {
        // fsync of a character device fails (EINVAL): the background flush's error
        // must surface at finish.
        let wb = Writeback::new(Arc::new(File::open("/dev/null").unwrap()));
        wb.wrote(WRITEBACK_STEP_BYTES);
        while wb.busy.load(Ordering::SeqCst) {
            tokio::time::sleep(std::time::Duration::from_millis(1)).await;
        }
        assert!(wb.error.lock().unwrap().is_some());
        assert!(wb.finish().is_err());
    }

    #[test]
    fn concurrent_callers_share_flushes_and_each_is_covered() {
        let dir = tempfile::tempdir_in(env!("CARGO_MANIFEST_DIR")).unwrap();
        let group = Arc::new(GroupSync::default());
        let threads: Vec<_> = (0..8)
            .map(|i| {
                let (group, path) = (group.clone(), dir.path().join(format!("f{i}")));
                std::thread::spawn(move || {
                    for _ in 0..20 {
                        let mut f = File::create(&path).unwrap();
                        f.write_all(b"data").unwrap();
                        group.sync(&f).unwrap();
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        let devs = group.devs.lock().unwrap();
        assert_eq!(devs.len(), 1);
        let state = devs.values().next().unwrap().state.lock().unwrap();
        assert!(!state.running);
        assert_eq!(state.started, state.finished);
        // Every caller waited for a flush of its own or a shared one: never more than
        // one flush per call, and at least one.
        assert!((1..=160).contains(&state.finished), "{}", state.finished);
        assert!(state.failed.is_none());
    }

    #[test]
    fn a_failed_flush_fails_the_caller_it_covered_and_no_later_one() {
        static CALLS: AtomicU64 = AtomicU64::new(0);
        let group = GroupSync {
            flush: |_| match CALLS.fetch_add(1, Ordering::SeqCst) {
                0 => Err(nix::errno::Errno::EIO),
                _ => Ok(()),
            },
            ..GroupSync::default()
        };
        let f = tempfile::tempfile().unwrap();
        let e = group.sync(&f).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(nix::libc::EIO));
        // The next caller waits for a flush of its own, which succeeds.
        group.sync(&f).unwrap();
        assert_eq!(CALLS.load(Ordering::SeqCst), 2);
    }

    #[test]
    fn syncs_each_filesystem_once_and_answers_per_file() {
        let dir = tempfile::tempdir_in(env!("CARGO_MANIFEST_DIR")).unwrap();
        let mut a = File::create(dir.path().join("a")).unwrap();
        let mut b = File::create(dir.path().join("b")).unwrap();
        a.write_all(b"one").unwrap();
        b.write_all(b"two").unwrap();
        let results = sync_filesystems(&[&a, &b, &a]);
        assert_eq!(results.len(), 3);
        assert!(results.iter().all(|r| r.is_ok()), "{results:?}");
        assert!(sync_filesystems(&[]).is_empty());
    }
}
