//! Direct I/O for the bulk data of big files: received chunks are written from the
//! registered chunk buffers straight to the disk (`O_DIRECT`), not copied into the page
//! cache first; a sent file's windows are read into registered buffers the same way,
//! except for what the page cache already holds, which is copied from there.
//!
//! Why: on the VMs this project is measured on, writing a file through the page cache
//! costs about 2.5 CPU-seconds per GB in the kernel (fresh page-cache pages fault in
//! from the hypervisor, and every byte is copied once more), and it bound both ends of
//! a big copy: `dd bs=4M` of 2 GiB to ext4 with `conv`-less buffered writes plus a
//! `sync` ran at 0.41 GB/s, the same with `oflag=direct` at 3.3 GB/s. A copy tool
//! that streams a file once gains nothing from caching it either.
//!
//! Invariants:
//! - Only whole aligned blocks go direct: the file offset, the length and the memory
//!   address are multiples of [`DIRECT_ALIGN`]. Any other part of a write (a file's
//!   last partial block, an unaligned buffer) is written through the page cache on the
//!   ordinary descriptor. Linux keeps the two coherent (a direct write invalidates the
//!   cached pages of its range), and the final `fsync` of the ordinary descriptor makes
//!   both durable, since it flushes the inode, not a descriptor's own writes.
//! - A filesystem that refuses `O_DIRECT` (at open, or with `EINVAL` at a write) makes
//!   the file fall back to buffered writes for good, after redoing that write
//!   buffered; nothing is lost or written twice to different places.
//! - A read whose range is all in the page cache ([`all_cached`]) is copied from it;
//!   any other reads its aligned blocks direct and the rest buffered. A file that ends
//!   early fails with [`io::ErrorKind::UnexpectedEof`], as `read_exact_at` does.
//! - Files smaller than [`DIRECT_MIN_FILE_BYTES`] are written buffered: direct I/O
//!   waits for the device on every write, which small files cannot amortise.
//! - A file whose size is not known in advance ([`DirectFile::on_demand`], a staged
//!   file written through a mount's handle) writes direct only pieces of at least
//!   [`DIRECT_MIN_WRITE_BYTES`] (a stream of big writes); smaller ones (a database's
//!   pages, random 4 KiB writes) stay buffered. Its direct descriptor is opened at the
//!   first such piece, so files that never see one pay nothing. Only for files no one
//!   else has mapped: a direct write cannot invalidate pages another process maps.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};

use crate::transport::sys::cached::all_cached;

/// Alignment of offsets, lengths and addresses of direct writes: a page, which covers
/// every logical block size Linux filesystems use.
pub const DIRECT_ALIGN: usize = 4096;

/// Files at least this big are written with direct I/O where the filesystem allows.
pub const DIRECT_MIN_FILE_BYTES: u64 = 8 << 20;

/// The smallest write an on-demand file ([`DirectFile::on_demand`]) sends direct.
pub const DIRECT_MIN_WRITE_BYTES: usize = 1 << 20;

/// A file being written or read, with a second, `O_DIRECT` descriptor for its aligned
/// blocks.
#[derive(Debug)]
pub struct DirectFile {
    file: Arc<File>,
    /// The `O_DIRECT` descriptor: set at construction, except for an on-demand file,
    /// which opens it at its first write of [`DIRECT_MIN_WRITE_BYTES`]; `None` inside
    /// where direct I/O is not used.
    direct: OnceLock<Option<File>>,
    /// Only writes of at least [`DIRECT_MIN_WRITE_BYTES`] go direct.
    on_demand: bool,
    /// False once the filesystem refused a direct write (or the direct open).
    enabled: AtomicBool,
}

impl DirectFile {
    /// Wraps `file` (open for writing), which will hold `size` bytes. For a file of at
    /// least [`DIRECT_MIN_FILE_BYTES`] it opens a direct descriptor on the same inode
    /// (through `/proc/self/fd`, so it works for a file with no name too); if that is
    /// refused, writes stay buffered. Blocking.
    pub fn for_writing(file: Arc<File>, size: u64) -> DirectFile {
        DirectFile::open(file, size, true)
    }

    /// Wraps `file` (open for reading), which holds `size` bytes, as
    /// [`DirectFile::for_writing`] does for writing. Blocking.
    pub fn for_reading(file: Arc<File>, size: u64) -> DirectFile {
        DirectFile::open(file, size, false)
    }

    fn open(file: Arc<File>, size: u64, write: bool) -> DirectFile {
        let direct = if size >= DIRECT_MIN_FILE_BYTES {
            reopen_direct(&file, write)
        } else {
            None
        };
        DirectFile {
            enabled: AtomicBool::new(direct.is_some()),
            file,
            direct: OnceLock::from(direct),
            on_demand: false,
        }
    }

    /// A file that is always written through the page cache.
    pub fn buffered(file: Arc<File>) -> DirectFile {
        DirectFile {
            file,
            direct: OnceLock::from(None),
            on_demand: false,
            enabled: AtomicBool::new(false),
        }
    }

    /// Wraps `file` (open for writing), of a size not known in advance, which nobody
    /// else maps: writes of at least [`DIRECT_MIN_WRITE_BYTES`] go direct where the
    /// filesystem allows (see the module docs), smaller ones buffered.
    pub fn on_demand(file: Arc<File>) -> DirectFile {
        DirectFile {
            file,
            direct: OnceLock::new(),
            on_demand: true,
            enabled: AtomicBool::new(true),
        }
    }

    /// True while aligned blocks are written direct (for an on-demand file: those of
    /// big writes, once its descriptor opens).
    pub fn is_direct(&self) -> bool {
        self.enabled.load(Ordering::Relaxed)
    }

    /// The direct descriptor for a write (`write`) or read of `len` bytes, if it goes
    /// direct; an on-demand file opens it here, at its first big write (its reads are
    /// buffered). Blocking.
    fn direct_for(&self, len: usize, write: bool) -> Option<&File> {
        if !self.is_direct() {
            return None;
        }
        if !self.on_demand {
            return self.direct.get().and_then(Option::as_ref);
        }
        if !write || len < DIRECT_MIN_WRITE_BYTES {
            return None;
        }
        let direct = self
            .direct
            .get_or_init(|| reopen_direct(&self.file, true))
            .as_ref();
        if direct.is_none() {
            self.enabled.store(false, Ordering::Relaxed);
        }
        direct
    }

    /// The ordinary (buffered) descriptor.
    pub fn file(&self) -> &Arc<File> {
        &self.file
    }

    /// Writes all of `buf` at `offset`: its aligned blocks direct where possible, the
    /// rest buffered. Blocking.
    pub fn write_all_at(&self, buf: &[u8], offset: u64) -> io::Result<()> {
        self.write_counted(buf, offset).map(|_| ())
    }

    /// [`DirectFile::write_all_at`], returning how many bytes were written buffered
    /// (left dirty in the page cache). Blocking.
    pub fn write_counted(&self, buf: &[u8], offset: u64) -> io::Result<usize> {
        let mut done = 0usize;
        if let Some(direct) = self.direct_for(buf.len(), true) {
            // A short write that ends mid-block: finished buffered from its last whole
            // block (the partial block is rewritten whole).
            done = self.direct_blocks(buf.as_ptr(), buf.len(), offset, "writes", |from, to| {
                match direct.write_at(&buf[from..to], offset + from as u64)? {
                    0 => Err(io::ErrorKind::WriteZero.into()),
                    n => Ok(n),
                }
            })?;
        }
        self.file.write_all_at(&buf[done..], offset + done as u64)?;
        Ok(buf.len() - done)
    }

    /// Fills all of `buf` from `offset`: copied from the page cache if it holds the
    /// whole range, else its aligned blocks read direct where possible and the rest
    /// buffered. Blocking.
    pub fn read_exact_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        let mut done = 0usize;
        let direct = self
            .direct_for(buf.len(), false)
            .filter(|_| !all_cached(&self.file, offset, buf.len()).unwrap_or(true));
        if let Some(direct) = direct {
            // The end of the file (or a short read mid-block): the buffered read takes
            // over from the last whole block.
            let (ptr, len) = (buf.as_ptr(), buf.len());
            done = self.direct_blocks(ptr, len, offset, "reads", |from, to| {
                direct.read_at(&mut buf[from..to], offset + from as u64)
            })?;
        }
        self.file
            .read_exact_at(&mut buf[done..], offset + done as u64)
    }

    /// Runs `op(from, to)` over the whole blocks of a buffer of `len` bytes at `ptr`,
    /// meant for `offset` in the file, until they are done or an operation comes back
    /// short; returns how many bytes are done, a multiple of [`DIRECT_ALIGN`] (0 if the
    /// buffer or the offset is not aligned). An `EINVAL` turns direct I/O off for this
    /// file (`what` names the operations in the log); other errors are returned.
    fn direct_blocks(
        &self,
        ptr: *const u8,
        len: usize,
        offset: u64,
        what: &str,
        mut op: impl FnMut(usize, usize) -> io::Result<usize>,
    ) -> io::Result<usize> {
        let aligned = (ptr as usize) % DIRECT_ALIGN == 0 && offset % DIRECT_ALIGN as u64 == 0;
        let whole = len / DIRECT_ALIGN * DIRECT_ALIGN;
        let mut done = 0usize;
        // Invariant of the loop: `done` is a multiple of DIRECT_ALIGN, so each
        // operation starts aligned in the file and in memory.
        while aligned && done < whole {
            match op(done, whole) {
                Ok(n) if n > 0 && n % DIRECT_ALIGN == 0 => done += n,
                Ok(n) => {
                    done += n / DIRECT_ALIGN * DIRECT_ALIGN;
                    break;
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) if e.raw_os_error() == Some(nix::libc::EINVAL) => {
                    tracing::debug!("direct {what} refused ({e}); going buffered");
                    self.enabled.store(false, Ordering::Relaxed);
                    break;
                }
                Err(e) => return Err(e),
            }
        }
        Ok(done)
    }
}

/// A second descriptor of `file`'s inode opened with `O_DIRECT`, for writing or for
/// reading, or `None` where the filesystem (or a missing `/proc`) does not allow it.
fn reopen_direct(file: &File, write: bool) -> Option<File> {
    let path = format!("/proc/self/fd/{}", file.as_raw_fd());
    match OpenOptions::new()
        .write(write)
        .read(!write)
        .custom_flags(nix::libc::O_DIRECT | nix::libc::O_CLOEXEC)
        .open(&path)
    {
        Ok(f) => Some(f),
        Err(e) => {
            tracing::debug!("no direct I/O here ({e}); writing buffered");
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transport::Buffer;
    use std::io::Read;

    fn pattern(len: usize, seed: u8) -> Vec<u8> {
        (0..len)
            .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
            .collect()
    }

    fn contents(f: &File) -> Vec<u8> {
        let mut out = Vec::new();
        let mut r = f.try_clone().unwrap();
        std::io::Seek::rewind(&mut r).unwrap();
        r.read_to_end(&mut out).unwrap();
        out
    }

    /// A file on the filesystem of the build directory (ext4 here; tmpfs /tmp may
    /// refuse O_DIRECT on older kernels, which is the fallback test's business).
    fn scratch() -> (tempfile::TempDir, Arc<File>) {
        let dir = tempfile::tempdir_in(env!("CARGO_MANIFEST_DIR")).unwrap();
        let f = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .open(dir.path().join("f"))
            .unwrap();
        (dir, Arc::new(f))
    }

    #[test]
    fn aligned_unaligned_and_tail_writes_all_land() {
        let (_dir, f) = scratch();
        let size = DIRECT_MIN_FILE_BYTES + 5000;
        let d = DirectFile::for_writing(f.clone(), size);
        let buf = Buffer::new(1 << 20).unwrap();
        let data = pattern(size as usize, 3);
        // Aligned 1 MiB pieces from a page-aligned buffer, then the tail, then an
        // unaligned rewrite in the middle from an ordinary Vec.
        let mut off = 0usize;
        while off < size as usize {
            let n = (size as usize - off).min(1 << 20);
            let mut b = buf.blocking_write();
            b[..n].copy_from_slice(&data[off..off + n]);
            d.write_all_at(&b[..n], off as u64).unwrap();
            off += n;
        }
        let patch = pattern(10_001, 9);
        d.write_all_at(&patch, 12_345).unwrap();
        let mut want = data.clone();
        want[12_345..12_345 + patch.len()].copy_from_slice(&patch);
        f.sync_all().unwrap();
        assert_eq!(contents(&f), want);
        // Read back through a reader: cold (dropped from the cache where the kernel
        // lets us), from every kind of offset, and past the end.
        let _ = nix::fcntl::posix_fadvise(
            f.as_raw_fd(),
            0,
            0,
            nix::fcntl::PosixFadviseAdvice::POSIX_FADV_DONTNEED,
        );
        let r = DirectFile::for_reading(f.clone(), size);
        let rb = Buffer::new(2 << 20).unwrap();
        for (off, len) in [
            (0usize, 1 << 20),
            (4096, 2 << 20),
            (12_000, 70_001),
            (size as usize - 5000, 5000),
        ] {
            let mut b = rb.blocking_write();
            r.read_exact_at(&mut b[..len], off as u64).unwrap();
            assert_eq!(&b[..len], &want[off..off + len], "at {off}+{len}");
        }
        let mut b = rb.blocking_write();
        let e = r.read_exact_at(&mut b[..8192], size - 4096).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::UnexpectedEof);
    }

    #[test]
    fn small_files_are_buffered_and_big_ones_direct_where_allowed() {
        let (_dir, f) = scratch();
        assert!(!DirectFile::for_writing(f.clone(), DIRECT_MIN_FILE_BYTES - 1).is_direct());
        assert!(!DirectFile::for_reading(f.clone(), DIRECT_MIN_FILE_BYTES - 1).is_direct());
        assert!(!DirectFile::buffered(f.clone()).is_direct());
        // The build directory is on a filesystem with O_DIRECT on every machine this
        // project runs on (ext4, xfs, btrfs); if it were not, the writes above still
        // pass, buffered.
        let d = DirectFile::for_writing(f, DIRECT_MIN_FILE_BYTES);
        if d.direct.get().is_some_and(Option::is_some) {
            assert!(d.is_direct());
        }
    }

    #[test]
    fn an_on_demand_file_writes_big_pieces_direct_and_small_ones_buffered() {
        let (_dir, f) = scratch();
        let d = DirectFile::on_demand(f.clone());
        let buf = Buffer::new(2 * DIRECT_MIN_WRITE_BYTES).unwrap();
        let data = pattern(2 * DIRECT_MIN_WRITE_BYTES + 8192, 5);
        // Small writes first: buffered, and no direct descriptor opened for them.
        assert_eq!(d.write_counted(&data[..4096], 0).unwrap(), 4096);
        assert!(d.direct.get().is_none(), "opened for a small write");
        // A big aligned piece from a page-aligned buffer: all direct (where allowed).
        let mut b = buf.blocking_write();
        b.copy_from_slice(&data[4096..4096 + 2 * DIRECT_MIN_WRITE_BYTES]);
        let buffered = d.write_counted(&b, 4096).unwrap();
        drop(b);
        if d.direct.get().is_some_and(Option::is_some) {
            assert_eq!(buffered, 0);
        } else {
            assert_eq!(buffered, 2 * DIRECT_MIN_WRITE_BYTES);
        }
        // A small write after it, over the end of the direct piece: buffered.
        let tail = 4096 + 2 * DIRECT_MIN_WRITE_BYTES - 100;
        assert_eq!(
            d.write_counted(&data[tail..], tail as u64).unwrap(),
            data.len() - tail
        );
        f.sync_all().unwrap();
        assert_eq!(contents(&f), data);
    }
}
