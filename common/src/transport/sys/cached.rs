//! Asking whether a file's range is in the page cache: `mincore(2)` on a mapping of
//! it that is never touched, so asking neither reads the disk nor starts readahead
//! (`preadv2` with `RWF_NOWAIT` does start readahead, which would read a cold range
//! twice).
//!
//! A reader that bypasses the cache for cold data (`O_DIRECT`) asks this first, so a
//! file that is hot in the cache is copied from memory rather than read from the disk
//! again.

use std::fs::File;
use std::io;

use memmap2::MmapOptions;

const PAGE: u64 = 4096;

/// True if every page of `file` in `offset..offset + len` is in the page cache now
/// (a range past the end of the file counts as not cached). Maps the range without
/// touching it, asks, and unmaps. Blocking only briefly.
pub fn all_cached(file: &File, offset: u64, len: usize) -> io::Result<bool> {
    if len == 0 {
        return Ok(true);
    }
    let start = offset / PAGE * PAGE;
    let span = usize::try_from(offset - start)
        .ok()
        .and_then(|head| head.checked_add(len))
        .ok_or(io::ErrorKind::InvalidInput)?;
    // SAFETY: the mapping is private and read-only, and no byte of it is ever read
    // or written here: only its address is passed to mincore, so a file changed or
    // truncated meanwhile cannot fault. It is unmapped when `map` drops.
    let map = unsafe { MmapOptions::new().offset(start).len(span).map(file)? };
    let pages = span.div_ceil(PAGE as usize);
    let mut vec = vec![0u8; pages];
    // SAFETY: `map` is a live mapping of `span` bytes at a page-aligned address, and
    // `vec` holds one byte for each of its pages, as mincore requires.
    let rc = unsafe { nix::libc::mincore(map.as_ptr() as *mut _, span, vec.as_mut_ptr()) };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(vec.iter().all(|v| v & 1 == 1))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;
    use std::os::fd::AsRawFd;

    #[test]
    fn tells_cached_from_dropped_and_past_the_end() {
        // On the build directory's filesystem: tmpfs never drops its pages.
        let dir = tempfile::tempdir_in(env!("CARGO_MANIFEST_DIR")).unwrap();
        let mut f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .open(dir.path().join("f"))
            .unwrap();
        f.write_all(&vec![5u8; 64 << 10]).unwrap();
        // Just written, so in the page cache.
        assert!(all_cached(&f, 0, 64 << 10).unwrap());
        assert!(all_cached(&f, 100, 5000).unwrap());
        assert!(!all_cached(&f, 60 << 10, 8 << 10).unwrap());
        f.sync_all().unwrap();
        nix::fcntl::posix_fadvise(
            f.as_raw_fd(),
            0,
            0,
            nix::fcntl::PosixFadviseAdvice::POSIX_FADV_DONTNEED,
        )
        .unwrap();
        assert!(!all_cached(&f, 0, 64 << 10).unwrap());
        assert!(all_cached(&f, 0, 0).unwrap());
    }
}
