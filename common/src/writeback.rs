//! Early writeback: flush a file being written in the background, so that the final
//! fsync before the rename has little left to do and the disk works while the network
//! does.
//!
//! Invariant: an error from a background flush is kept and returned by
//! [`Writeback::finish`]. (Linux reports a writeback error to one fsync per open file
//! only, so a background flush that swallowed it would let the final fsync succeed on
//! lost data.)

use std::fs::File;
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
}
