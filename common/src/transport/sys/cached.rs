//! Asking whether a file's range is in the page cache: `cachestat(2)` (Linux 6.5 and
//! later), or else `mincore(2)` on a mapping of it that is never touched. Asking
//! neither reads the disk nor starts readahead (`preadv2` with `RWF_NOWAIT` does start
//! readahead, which would read a cold range twice). `cachestat` is one system call
//! where the mapping costs three, and its `munmap` a TLB shootdown on every CPU that
//! runs one of the process's threads: a download asks once per chunk.
//!
//! A reader that bypasses the cache for cold data (`O_DIRECT`) asks this first, so a
//! file that is hot in the cache is copied from memory rather than read from the disk
//! again.

use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, Ordering};

use memmap2::MmapOptions;

const PAGE: u64 = 4096;

/// `cachestat(2)`'s number: new system calls have one number on every architecture.
const SYS_CACHESTAT: nix::libc::c_long = 451;

/// Set once `cachestat` is found missing (ENOSYS: a kernel before 6.5) or filtered
/// (EPERM: a seccomp policy that does not know it); `mincore` answers from then on.
static NO_CACHESTAT: AtomicBool = AtomicBool::new(false);

/// `struct cachestat_range` of <linux/mman.h>.
#[repr(C)]
struct CachestatRange {
    off: u64,
    len: u64,
}

/// `struct cachestat` of <linux/mman.h>.
#[repr(C)]
#[derive(Default)]
struct Cachestat {
    nr_cache: u64,
    nr_dirty: u64,
    nr_writeback: u64,
    nr_evicted: u64,
    nr_recently_evicted: u64,
}

/// True if every page of `file` in `offset..offset + len` is in the page cache now
/// (a range past the end of the file counts as not cached). Blocking only briefly.
pub fn all_cached(file: &File, offset: u64, len: usize) -> io::Result<bool> {
    if len == 0 {
        return Ok(true);
    }
    if let Some(answer) = cachestat_all(file, offset, len) {
        return answer;
    }
    let start = offset / PAGE * PAGE;
    let span = usize::try_from(offset - start)
        .ok()
        .and_then(|head| head.checked_add(len))
        .ok_or(io::ErrorKind::InvalidInput)?;
    mincore_all(file, start, span)
}

/// `all_cached` by `cachestat(2)`, or `None` where the kernel does not offer it.
/// `len` is not 0 (which would mean "to the end of the file").
fn cachestat_all(file: &File, offset: u64, len: usize) -> Option<io::Result<bool>> {
    if NO_CACHESTAT.load(Ordering::Relaxed) {
        return None;
    }
    let page = match nix::unistd::sysconf(nix::unistd::SysconfVar::PAGE_SIZE) {
        Ok(Some(p)) if p > 0 => p as u64,
        _ => return None,
    };
    let end = match offset.checked_add(len as u64) {
        Some(end) => end,
        None => return Some(Err(io::ErrorKind::InvalidInput.into())),
    };
    // The pages the kernel counts: those that hold a byte of the range.
    let pages = (end - 1) / page - offset / page + 1;
    let range = CachestatRange {
        off: offset,
        len: len as u64,
    };
    let mut stat = Cachestat::default();
    // SAFETY: `range` and `stat` are live, `#[repr(C)]` copies of the kernel's structs
    // for the whole call; the kernel only reads `range` and only writes `stat`. The
    // descriptor is `file`'s, open for the call's duration.
    let rc = unsafe {
        nix::libc::syscall(
            SYS_CACHESTAT,
            file.as_raw_fd(),
            &range as *const CachestatRange,
            &mut stat as *mut Cachestat,
            0,
        )
    };
    if rc != 0 {
        let e = io::Error::last_os_error();
        return match e.raw_os_error() {
            Some(nix::libc::ENOSYS) | Some(nix::libc::EPERM) => {
                NO_CACHESTAT.store(true, Ordering::Relaxed);
                None
            }
            _ => Some(Err(e)),
        };
    }
    Some(Ok(stat.nr_cache >= pages))
}

/// `all_cached` by `mincore(2)` over `span` bytes from the page-aligned `start`: maps
/// the range without touching it, asks, and unmaps.
fn mincore_all(file: &File, start: u64, span: usize) -> io::Result<bool> {
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

    /// A new file on the build directory's filesystem (tmpfs never drops its pages).
    fn scratch() -> (tempfile::TempDir, File) {
        let dir = tempfile::tempdir_in(env!("CARGO_MANIFEST_DIR")).unwrap();
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .open(dir.path().join("f"))
            .unwrap();
        (dir, f)
    }

    #[test]
    fn tells_cached_from_dropped_and_past_the_end() {
        let (_dir, mut f) = scratch();
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

    /// Both ways of asking answer alike, where the kernel has both (cachestat: 6.5+):
    /// on a file all in the cache, all dropped, and partly read back.
    #[test]
    fn cachestat_and_mincore_agree() {
        let (_dir, mut f) = scratch();
        f.write_all(&vec![7u8; 256 << 10]).unwrap();
        f.sync_all().unwrap();
        let ranges = [
            (0u64, 64usize << 10),
            (0, 100 << 10),
            (95 << 10, 2 << 10),
            (160 << 10, 96 << 10),
            (161 << 10, 1),
            (250 << 10, 12 << 10),
            (300 << 10, 4 << 10),
        ];
        let advise = |offset: i64, len: i64, advice| {
            nix::fcntl::posix_fadvise(f.as_raw_fd(), offset, len, advice).unwrap();
        };
        let compare = |state: &str, whole: bool| {
            for (offset, len) in ranges {
                let start = offset / PAGE * PAGE;
                let span = (offset - start) as usize + len;
                let by_mincore = mincore_all(&f, start, span).unwrap();
                if whole {
                    // Past the end of the file never counts as cached.
                    assert_eq!(by_mincore, offset + len as u64 <= 256 << 10, "{state}");
                }
                match cachestat_all(&f, offset, len) {
                    Some(by_cachestat) => assert_eq!(
                        by_cachestat.unwrap(),
                        by_mincore,
                        "{state}, {offset}+{len}: cachestat and mincore differ"
                    ),
                    None => eprintln!("no cachestat(2) here: mincore alone is checked"),
                }
            }
        };
        compare("just written", true);
        advise(0, 0, nix::fcntl::PosixFadviseAdvice::POSIX_FADV_DONTNEED);
        assert!(!mincore_all(&f, 0, 4096).unwrap());
        compare("dropped", false);
        advise(0, 0, nix::fcntl::PosixFadviseAdvice::POSIX_FADV_RANDOM);
        let mut head = vec![0u8; 64 << 10];
        std::os::unix::fs::FileExt::read_exact_at(&f, &mut head, 0).unwrap();
        assert!(mincore_all(&f, 0, 64 << 10).unwrap());
        compare("its head read back", false);
    }
}
