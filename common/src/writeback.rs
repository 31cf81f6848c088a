//! Early writeback and group commits.
//!
//! [`Writeback`]: flush a file being written in the background, so that the final
//! fsync before the rename has little left to do and the disk works while the network
//! does.
//!
//! [`sync_filesystems`]: making many files durable at once, one `syncfs(2)` per
//! filesystem that a group of files lives on, the group commit a receiver of a batch
//! of small files uses.
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
use std::sync::{Arc, Mutex};

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
        if let Some(e) = self.error.lock().unwrap_or_else(|p| p.into_inner()).take() {
            return Err(e);
        }
        synced
    }
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
    let mut flushed: HashMap<u64, Result<(), i32>> = HashMap::new();
    for (file, dev) in files.iter().zip(&devs) {
        if let Ok(dev) = dev {
            flushed
                .entry(*dev)
                .or_insert_with(|| nix::unistd::syncfs(file.as_raw_fd()).map_err(|e| e as i32));
        }
    }
    devs.into_iter()
        .map(|dev| match flushed.get(&dev?) {
            Some(Err(errno)) => Err(io::Error::from_raw_os_error(*errno)),
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
