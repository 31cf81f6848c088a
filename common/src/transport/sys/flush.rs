//! Starting a file's writeback without waiting for it: `sync_file_range(2)` with
//! `SYNC_FILE_RANGE_WRITE`, which nix does not wrap.
//!
//! A receiver that makes many small files durable at once starts the writeback of each
//! first, then fsyncs each: the disk then writes them together, and on ext4 the first
//! fsync's journal commit covers the others (measured on this project's VMs: 256 files
//! of 4 KiB in 70-150 ms this way, against 200-1100 ms with fsync alone and 140-600 ms
//! with one `syncfs`, which also flushes everything else on the filesystem).

use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;

/// Starts writing `file`'s dirty pages to its disk and returns without waiting. Says
/// nothing about durability: an `fsync` must follow. Blocking (briefly).
pub fn start_writeback(file: &File) -> io::Result<()> {
    // SAFETY: sync_file_range only reads its integer arguments; the descriptor is
    // borrowed from `file`, which stays open for the duration of the call, and a
    // length of 0 means "to the end of the file".
    let rc = unsafe {
        nix::libc::sync_file_range(file.as_raw_fd(), 0, 0, nix::libc::SYNC_FILE_RANGE_WRITE)
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    #[test]
    fn writeback_starts_on_a_file_and_fails_on_a_pipe() {
        let mut f = tempfile::tempfile().unwrap();
        f.write_all(&[7u8; 8192]).unwrap();
        start_writeback(&f).unwrap();
        f.sync_all().unwrap();
        let (r, _w) = nix::unistd::pipe().unwrap();
        let e = start_writeback(&File::from(r)).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(nix::libc::ESPIPE));
    }
}
