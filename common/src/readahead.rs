//! Reading many small files whose pages are cold: open a window of files first and
//! ask the kernel to read each one in ([`will_need`]), then read them in order.
//!
//! Why: a `pread` of a cold 4 KiB file waits for one disk read, so a loop over a batch
//! of small files keeps one read in flight at a time. `POSIX_FADV_WILLNEED` submits a
//! file's read and returns without waiting, so a window of [`READ_AHEAD_FILES`] files
//! keeps that many reads in flight and the `pread`s that follow mostly find their pages
//! in the page cache. Only a hint: what is read, and every check made on it, is the
//! same as without it.

use std::fs::File;
use std::os::fd::AsRawFd;

/// Files of a batch opened, and their reads started, ahead of the one being read.
pub const READ_AHEAD_FILES: usize = 32;

/// Starts reading the first `len_bytes` of `file` into the page cache, without
/// waiting. A failure is ignored: the read that follows does the work instead.
pub fn will_need(file: &File, len_bytes: u64) {
    let Ok(len) = i64::try_from(len_bytes) else {
        return;
    };
    if len == 0 {
        return;
    }
    let _ = nix::fcntl::posix_fadvise(
        file.as_raw_fd(),
        0,
        len,
        nix::fcntl::PosixFadviseAdvice::POSIX_FADV_WILLNEED,
    );
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;
    use std::os::unix::fs::FileExt;

    #[test]
    fn a_hinted_file_reads_the_same() {
        let mut f = tempfile::tempfile().unwrap();
        f.write_all(b"hello, world").unwrap();
        will_need(&f, 12);
        will_need(&f, 0);
        will_need(&f, u64::MAX);
        let mut b = [0u8; 12];
        f.read_exact_at(&mut b, 0).unwrap();
        assert_eq!(&b, b"hello, world");
    }
}
