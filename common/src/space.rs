//! Reserving disk space for a file before its bytes arrive.
//!
//! Both ends write a received file into a hidden temporary file of a size known in
//! advance (an upload's declared size on the server, a download's size on the client).
//! [`reserve`] allocates that size up front, so that:
//!
//! - a file that does not fit fails at once with "no space", before any data moves;
//! - once reserved, its writes cannot run out of space half-way, and the files of a
//!   tree copied at the same time do not take each other's space: each either fits
//!   whole or fails at its start.
//!
//! [`release`] gives back the space of chunks an interrupted transfer never received,
//! so a partial file kept for resuming holds only what arrived.

use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::sync::{Arc, Condvar, Mutex};

use nix::errno::Errno;
use nix::fcntl::{fallocate, FallocateFlags};

/// Allocates bytes `0..len_bytes` of `file` (`fallocate(2)`, mode 0), growing its size
/// to at least `len_bytes`. Blocking.
///
/// A full filesystem fails with `ENOSPC` (or `EDQUOT` for a quota), having allocated
/// nothing that outlives the file. A filesystem without `fallocate` is not an error:
/// there the writes themselves report a full disk. Copy-on-write filesystems may still
/// fail a later write with `ENOSPC`; callers must handle write errors as before.
pub fn reserve(file: &File, len_bytes: u64) -> io::Result<()> {
    if len_bytes == 0 {
        return Ok(());
    }
    let len = i64::try_from(len_bytes).map_err(|_| io::Error::from(Errno::EFBIG))?;
    loop {
        match fallocate(file.as_raw_fd(), FallocateFlags::empty(), 0, len) {
            Ok(()) => return Ok(()),
            // tmpfs gives up a long allocation when a signal arrives.
            Err(Errno::EINTR) => continue,
            Err(Errno::EOPNOTSUPP | Errno::ENOSYS) => return Ok(()),
            Err(e) => return Err(e.into()),
        }
    }
}

/// Chunks a received file may have and still be reserved before its first window:
/// one window of rcp's (16 chunks, 16 MiB). A bigger file is reserved beside its first
/// windows ([`Deferred`]).
pub const RESERVE_BEFORE_CHUNKS: u64 = 16;

/// True if a file of `size` bytes in chunks of `chunk_bytes` is reserved beside its
/// first windows rather than before them (see [`RESERVE_BEFORE_CHUNKS`]).
pub fn reserve_beside(size: u64, chunk_bytes: u32) -> bool {
    size > u64::from(chunk_bytes).saturating_mul(RESERVE_BEFORE_CHUNKS)
}

/// A reservation made beside a transfer's first windows rather than before them.
///
/// A file system that allocates every page at once (tmpfs, which also clears each one)
/// takes long to reserve a big file, on one core: 0.6 to 1.1 s for 256 MiB in the
/// Soft-RoCE VM, a tenth of the copy, with nothing on the wire meanwhile. With a
/// `Deferred` ([`Deferred::start`]), a thread of its own runs [`Deferred::make`] while
/// the first windows cross the wire and are verified, and every write into the file
/// waits for it first ([`Deferred::wait`]). So a file that does not fit still fails whole, with the
/// reservation's error, before any of its bytes is written; only bytes already on
/// the wire are wasted.
///
/// Invariant: once [`Deferred::make`] returned, every [`Deferred::wait`] returns its
/// outcome at once; before, each blocks until it does.
#[derive(Debug, Default)]
pub struct Deferred {
    outcome: Mutex<Option<Outcome>>,
    made: Condvar,
}

/// A reservation's outcome, kept so that every waiter gets the same error.
#[derive(Debug, Clone)]
enum Outcome {
    Reserved,
    Failed {
        os: Option<i32>,
        kind: io::ErrorKind,
        message: String,
    },
}

impl Deferred {
    /// A reservation not made yet.
    pub fn new() -> Deferred {
        Deferred::default()
    }

    /// Starts reserving `len_bytes` of `file` on a thread of its own. Not on a pool's:
    /// writers block on the reservation from pool threads (tokio's blocking pool),
    /// which a reservation queued behind them for a thread would never get. Where no
    /// thread can be started, the reservation is made here and now. Blocking then.
    pub fn start(file: Arc<File>, len_bytes: u64) -> Arc<Deferred> {
        let deferred = Arc::new(Deferred::new());
        let (d, f) = (deferred.clone(), file.clone());
        let spawned = std::thread::Builder::new()
            .name("ferry-reserve".into())
            .spawn(move || {
                let _ = d.make(&f, len_bytes);
            });
        if spawned.is_err() {
            let _ = deferred.make(&file, len_bytes);
        }
        deferred
    }

    /// Reserves `len_bytes` of `file` ([`reserve`]) and wakes every waiter with the
    /// outcome, which it also returns. Blocking.
    pub fn make(&self, file: &File, len_bytes: u64) -> io::Result<()> {
        let result = reserve(file, len_bytes);
        let outcome = match &result {
            Ok(()) => Outcome::Reserved,
            Err(e) => Outcome::Failed {
                os: e.raw_os_error(),
                kind: e.kind(),
                message: e.to_string(),
            },
        };
        *self.outcome.lock().unwrap_or_else(|p| p.into_inner()) = Some(outcome);
        self.made.notify_all();
        result
    }

    /// Waits until [`Deferred::make`] has run; its error, if it failed. Blocking.
    pub fn wait(&self) -> io::Result<()> {
        let mut outcome = self.outcome.lock().unwrap_or_else(|p| p.into_inner());
        loop {
            match &*outcome {
                Some(Outcome::Reserved) => return Ok(()),
                Some(Outcome::Failed { os, kind, message }) => {
                    return Err(match os {
                        Some(code) => io::Error::from_raw_os_error(*code),
                        None => io::Error::new(*kind, message.clone()),
                    })
                }
                None => {
                    outcome = self.made.wait(outcome).unwrap_or_else(|p| p.into_inner());
                }
            }
        }
    }
}

/// Gives back the space of bytes `offset..offset + len_bytes` of `file` without
/// changing its size (`fallocate(2)` punching a hole): those bytes read as zeros
/// afterwards. Best effort: a filesystem that cannot punch holes keeps the space.
/// Blocking.
pub fn release(file: &File, offset: u64, len_bytes: u64) -> io::Result<()> {
    let (Ok(offset), Ok(len)) = (i64::try_from(offset), i64::try_from(len_bytes)) else {
        return Err(Errno::EFBIG.into());
    };
    if len == 0 {
        return Ok(());
    }
    let flags = FallocateFlags::FALLOC_FL_PUNCH_HOLE | FallocateFlags::FALLOC_FL_KEEP_SIZE;
    loop {
        match fallocate(file.as_raw_fd(), flags, offset, len) {
            Ok(()) => return Ok(()),
            Err(Errno::EINTR) => continue,
            Err(Errno::EOPNOTSUPP | Errno::ENOSYS) => return Ok(()),
            Err(e) => return Err(e.into()),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::MetadataExt;

    use super::*;

    #[test]
    fn reserving_grows_the_file_and_allocates_it() {
        let file = tempfile::tempfile().unwrap();
        reserve(&file, 3 << 20).unwrap();
        let meta = file.metadata().unwrap();
        assert_eq!(meta.len(), 3 << 20);
        // Allocated, not just a sparse size.
        assert!(meta.blocks() * 512 >= 3 << 20, "{} blocks", meta.blocks());
        reserve(&file, 0).unwrap();
        assert_eq!(file.metadata().unwrap().len(), 3 << 20);
    }

    #[test]
    fn released_space_reads_as_zeros_and_the_size_stays() {
        use std::os::unix::fs::FileExt;
        let file = tempfile::tempfile().unwrap();
        reserve(&file, 3 << 20).unwrap();
        file.write_all_at(&[7u8; 1 << 20], 1 << 20).unwrap();
        let before = file.metadata().unwrap().blocks();
        release(&file, 1 << 20, 1 << 20).unwrap();
        let meta = file.metadata().unwrap();
        assert_eq!(meta.len(), 3 << 20);
        assert!(
            meta.blocks() <= before,
            "{} > {before} blocks",
            meta.blocks()
        );
        // Where the filesystem punched the hole, its bytes are gone.
        if meta.blocks() < before {
            let mut b = [1u8; 16];
            file.read_exact_at(&mut b, (1 << 20) + 5).unwrap();
            assert_eq!(b, [0; 16]);
        }
    }

    #[test]
    fn a_deferred_reservation_started_on_its_own_thread_is_made() {
        let file = Arc::new(tempfile::tempfile().unwrap());
        let deferred = Deferred::start(file.clone(), 3 << 20);
        deferred.wait().unwrap();
        assert_eq!(file.metadata().unwrap().len(), 3 << 20);
        let e = Deferred::start(file, u64::MAX).wait().unwrap_err();
        assert_eq!(e.raw_os_error(), Some(Errno::EFBIG as i32));
    }

    #[test]
    fn a_deferred_reservation_holds_its_waiters_until_made() {
        let file = tempfile::tempfile().unwrap();
        let deferred = Arc::new(Deferred::new());
        let waiters: Vec<_> = (0..3)
            .map(|_| {
                let d = deferred.clone();
                let f = file.try_clone().unwrap();
                // A waiter sees the size reserved once it returns.
                std::thread::spawn(move || d.wait().map(|()| f.metadata().unwrap().len()))
            })
            .collect();
        std::thread::sleep(std::time::Duration::from_millis(20));
        assert!(
            waiters.iter().all(|w| !w.is_finished()),
            "a waiter returned before the reservation was made"
        );
        deferred.make(&file, 3 << 20).unwrap();
        for w in waiters {
            assert_eq!(w.join().unwrap().unwrap(), 3 << 20);
        }
        deferred.wait().unwrap();
    }

    #[test]
    fn every_waiter_of_a_failed_deferred_reservation_gets_its_error() {
        let file = tempfile::tempfile().unwrap();
        let deferred = Deferred::new();
        let e = deferred.make(&file, u64::MAX).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(Errno::EFBIG as i32));
        for _ in 0..2 {
            let e = deferred.wait().unwrap_err();
            assert_eq!(e.raw_os_error(), Some(Errno::EFBIG as i32));
        }
    }

    #[test]
    fn a_size_beyond_what_a_file_can_hold_is_an_error() {
        let file = tempfile::tempfile().unwrap();
        let e = reserve(&file, u64::MAX).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(Errno::EFBIG as i32));
        assert_eq!(file.metadata().unwrap().len(), 0);
    }
}
