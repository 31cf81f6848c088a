//! Memory that can be registered with a transport.
//!
//! Two kinds exist, as the design requires:
//!
//! - [`FileWindow`]: a read-only mapping of a window of a file (memmap2). Uploads
//!   register these so the server can RDMA-READ the source without a copy.
//! - [`Buffer`]: anonymous, page-aligned, writable memory. Writable registrations always
//!   use these: since Linux 6.5 a long-term writable pin of a file-backed shared mapping
//!   fails on ext4/xfs, so a file is never registered writable.
//!
//! A [`Buffer`]'s bytes sit behind an async `RwLock`. Invariant: the application only
//! holds the lock briefly (to fill or read the buffer) and never while a one-sided
//! operation on the buffer is outstanding; the transport engine takes it to copy
//! network data in or out. This mirrors RDMA, where memory under an outstanding work
//! request belongs to the device. The verbs transport holds an owned guard for as long
//! as a local work request on the buffer is outstanding. A buffer registered for remote
//! write is the exception that RDMA imposes: the peer's device may write it whenever the
//! registration lives, so the protocol reads it only after the peer reports the WRITE
//! complete (and revokes the registration first).

use std::fs::File;
use std::sync::Arc;

use memmap2::{Mmap, MmapMut, MmapOptions};
use tokio::sync::{
    OwnedRwLockReadGuard, OwnedRwLockWriteGuard, RwLock, RwLockReadGuard, RwLockWriteGuard,
};

/// A read-only mapping of `len` bytes of a file starting at `offset`.
#[derive(Debug)]
pub struct FileWindow {
    map: Mmap,
    offset: u64,
    /// A duplicate of the mapped file's descriptor, for [`FileWindow::read_at`].
    file: File,
}

impl FileWindow {
    /// Maps `len` bytes of `file` at `offset` read-only. `len` must be non-zero.
    ///
    /// If another process truncates the file while it is mapped, touching the vanished
    /// pages raises SIGBUS, as with every mmap reader; a concurrent in-place change shows
    /// up as a chunk hash mismatch at the server, never as silently wrong data.
    pub fn map(file: &File, offset: u64, len: usize) -> std::io::Result<Arc<FileWindow>> {
        // SAFETY: the mapping is private to this value and read-only (PROT_READ), so no
        // Rust reference aliases a writable view. The file may still change underneath
        // (another process); Ferry treats the bytes as untrusted input that is hashed
        // and verified, never as data with Rust-level invariants.
        // MAP_POPULATE: fault the window in with one call instead of one fault per page
        // while it is hashed and sent.
        let map = unsafe {
            MmapOptions::new()
                .offset(offset)
                .len(len)
                .populate()
                .map(file)?
        };
        Ok(Arc::new(FileWindow {
            map,
            offset,
            file: file.try_clone()?,
        }))
    }

    /// Like [`FileWindow::map`] but without faulting the pages in: for windows that are
    /// registered and then read only here and there (a mapped file served to a FUSE
    /// client), where populating a multi-GiB window would read the whole file at once.
    pub fn map_lazy(file: &File, offset: u64, len: usize) -> std::io::Result<Arc<FileWindow>> {
        // SAFETY: as in `map`: private to this value, read-only, and the bytes are
        // treated as untrusted input that is hashed and verified.
        let map = unsafe { MmapOptions::new().offset(offset).len(len).map(file)? };
        Ok(Arc::new(FileWindow {
            map,
            offset,
            file: file.try_clone()?,
        }))
    }

    /// The mapped bytes.
    ///
    /// Touching them raises SIGBUS if the file was truncated below them since it was
    /// mapped (see [`FileWindow::map`]). A process that must outlive such a truncation
    /// (a server serving files it does not control) copies with
    /// [`FileWindow::read_at`] instead.
    pub fn bytes(&self) -> &[u8] {
        &self.map
    }

    /// Copies `buf.len()` bytes of the window, starting `offset` bytes into it, with
    /// `pread(2)` on the window's file descriptor: never through the mapping, so a file
    /// that shrank fails this call instead of raising SIGBUS.
    ///
    /// The bytes are those of the file now (the same the shared mapping shows).
    /// Errors: [`std::io::ErrorKind::InvalidInput`] if the range reaches past the
    /// window, [`std::io::ErrorKind::UnexpectedEof`] if the file now ends inside it
    /// (it was truncated), or the OS error of the read.
    pub fn read_at(&self, offset: usize, buf: &mut [u8]) -> std::io::Result<()> {
        use std::os::unix::fs::FileExt;
        if offset
            .checked_add(buf.len())
            .is_none_or(|end| end > self.map.len())
        {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                "read outside the mapped window",
            ));
        }
        // In range by the check above: offset <= map.len(), which fits a u64.
        let at = self.offset + offset as u64;
        self.file.read_exact_at(buf, at).map_err(|e| {
            if e.kind() == std::io::ErrorKind::UnexpectedEof {
                std::io::Error::new(
                    std::io::ErrorKind::UnexpectedEof,
                    format!(
                        "the mapped file ends before byte {} (it was truncated)",
                        at + buf.len() as u64
                    ),
                )
            } else {
                e
            }
        })
    }

    /// [`FileWindow::read_at`], but only from the page cache: `preadv2(2)` with
    /// `RWF_NOWAIT`, which never waits for the disk. `true` if all of `buf` was read;
    /// `false` if any of it was not cached, the kernel or filesystem does not support
    /// the flag, the file now ends inside the range, or the read failed: the caller
    /// then takes the blocking path ([`FileWindow::read_at`]), which reports what went
    /// wrong. The contents of `buf` are unspecified after `false`.
    pub fn read_cached_at(&self, offset: usize, buf: &mut [u8]) -> bool {
        self.read_cached_prefix(offset, buf) == buf.len()
    }

    /// How many leading bytes of `buf` [`FileWindow::read_cached_at`]'s one
    /// `RWF_NOWAIT` read filled (the range's first bytes, from the page cache): all of
    /// them, some, or 0 (nothing cached, no support, out of the window, or an error).
    /// The rest is for the blocking path to read.
    pub fn read_cached_prefix(&self, offset: usize, buf: &mut [u8]) -> usize {
        if offset
            .checked_add(buf.len())
            .is_none_or(|end| end > self.map.len())
        {
            return 0;
        }
        let Ok(at) = nix::libc::off_t::try_from(self.offset + offset as u64) else {
            return 0;
        };
        let iov = nix::libc::iovec {
            iov_base: buf.as_mut_ptr().cast(),
            iov_len: buf.len(),
        };
        // SAFETY: `iov` describes `buf`, which is valid for writes of `buf.len()` bytes
        // and exclusively borrowed for the whole call; the descriptor is owned by
        // `self.file` and open. preadv2 writes at most `iov_len` bytes into it.
        let n = unsafe {
            nix::libc::preadv2(
                std::os::fd::AsRawFd::as_raw_fd(&self.file),
                &iov,
                1,
                at,
                nix::libc::RWF_NOWAIT,
            )
        };
        usize::try_from(n).unwrap_or(0)
    }

    /// File offset of the first mapped byte.
    pub fn offset(&self) -> u64 {
        self.offset
    }

    /// Address of the first byte in this process.
    pub fn addr(&self) -> u64 {
        self.map.as_ptr() as u64
    }

    /// Mapped length in bytes.
    pub fn len(&self) -> usize {
        self.map.len()
    }

    /// True if the window is empty (never, for a window made by [`FileWindow::map`]).
    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }
}

/// What the SIGBUS handler prints and the code it exits with (set once).
static SIGBUS_EXIT: std::sync::OnceLock<(&'static [u8], i32)> = std::sync::OnceLock::new();

extern "C" fn on_sigbus(_signal: nix::libc::c_int) {
    if let Some((message, code)) = SIGBUS_EXIT.get() {
        // SAFETY: write(2) and _exit(2) are async-signal-safe; `message` is a
        // 'static byte slice, valid for the whole process.
        unsafe {
            nix::libc::write(2, message.as_ptr().cast(), message.len());
            nix::libc::_exit(*code);
        }
    }
    // SAFETY: _exit is async-signal-safe; without a message there is nothing to say.
    unsafe { nix::libc::_exit(128 + nix::libc::SIGBUS) }
}

/// Makes SIGBUS — raised when a mapped file shrinks under a [`FileWindow`] — print
/// `message` on stderr and exit with `code`, instead of killing the process without a
/// word. For binaries that map files they do not control (rcp uploads); the first call
/// wins. A peer that was pulling the window sees the connection drop and discards its
/// partial copy.
pub fn exit_on_sigbus(message: &'static [u8], code: i32) -> nix::Result<()> {
    use nix::sys::signal::{sigaction, SaFlags, SigAction, SigHandler, SigSet, Signal};
    let _ = SIGBUS_EXIT.set((message, code));
    let action = SigAction::new(
        SigHandler::Handler(on_sigbus),
        SaFlags::empty(),
        SigSet::empty(),
    );
    // SAFETY: the handler only reads a OnceLock that was set before it was installed
    // and calls async-signal-safe functions.
    unsafe { sigaction(Signal::SIGBUS, &action) }.map(|_| ())
}

/// The size of a transparent huge page on x86-64 and most arm64 kernels: buffers at
/// least this long ask for them.
const HUGE_PAGE_BYTES: usize = 2 << 20;

/// Anonymous, page-aligned, writable memory of a fixed length.
#[derive(Debug)]
pub struct Buffer {
    data: Arc<RwLock<MmapMut>>,
    addr: u64,
    len: usize,
}

impl Buffer {
    /// Allocates `len` bytes (at least one page is mapped). The pages are populated
    /// here so that later transfers do not pay for first-touch faults: with one
    /// `MADV_POPULATE_WRITE` (Linux 5.14 and later) rather than a fault per page, which
    /// a process that sets up dozens of MiB of buffers pays for at every start; on an
    /// older kernel, by touching each page. Buffers of a few MiB and more may take
    /// transparent huge pages where the system allows them on request.
    pub fn new(len: usize) -> std::io::Result<Arc<Buffer>> {
        let mut map = MmapOptions::new().len(len.max(1)).map_anon()?;
        if map.len() >= HUGE_PAGE_BYTES {
            // Advice only: a kernel without THP refuses it, and nothing changes.
            let _ = map.advise(memmap2::Advice::HugePage);
        }
        if map.advise(memmap2::Advice::PopulateWrite).is_err() {
            for page in map.chunks_mut(4096) {
                page[0] = 0;
            }
        }
        let addr = map.as_ptr() as u64;
        Ok(Arc::new(Buffer {
            data: Arc::new(RwLock::new(map)),
            addr,
            len,
        }))
    }

    /// Shared access to the bytes (`..len`).
    pub async fn read(&self) -> BufferRead<'_> {
        BufferRead {
            guard: self.data.read().await,
            len: self.len,
        }
    }

    /// Shared access if no one holds exclusive access now; `None` otherwise.
    pub fn try_read(&self) -> Option<BufferRead<'_>> {
        Some(BufferRead {
            guard: self.data.try_read().ok()?,
            len: self.len,
        })
    }

    /// Exclusive access to the bytes (`..len`).
    pub async fn write(&self) -> BufferWrite<'_> {
        BufferWrite {
            guard: self.data.write().await,
            len: self.len,
        }
    }

    /// Exclusive access held by a transport for the life of a work request that writes
    /// the buffer (an RDMA READ into it).
    pub async fn write_owned(&self) -> OwnedRwLockWriteGuard<MmapMut> {
        self.data.clone().write_owned().await
    }

    /// Shared access held by a transport for the life of a work request that reads the
    /// buffer (an RDMA WRITE or SEND out of it).
    pub async fn read_owned(&self) -> OwnedRwLockReadGuard<MmapMut> {
        self.data.clone().read_owned().await
    }

    /// Shared access from a blocking thread (never from async code: it would block a
    /// runtime worker).
    pub fn blocking_read(&self) -> BufferRead<'_> {
        BufferRead {
            guard: self.data.blocking_read(),
            len: self.len,
        }
    }

    /// Exclusive access from a blocking thread (never from async code).
    pub fn blocking_write(&self) -> BufferWrite<'_> {
        BufferWrite {
            guard: self.data.blocking_write(),
            len: self.len,
        }
    }

    /// Copies all of `window` into the buffer's first bytes with `pread(2)` (so a file
    /// that shrank fails here rather than raising SIGBUS). For a buffer nobody else
    /// uses: fails with [`std::io::ErrorKind::WouldBlock`] if its lock is held, and with
    /// [`std::io::ErrorKind::InvalidInput`] if the window is longer than the buffer.
    pub fn fill_from(&self, window: &FileWindow) -> std::io::Result<()> {
        use std::io::{Error, ErrorKind};
        if window.len() > self.len {
            return Err(Error::new(
                ErrorKind::InvalidInput,
                "file window longer than the buffer",
            ));
        }
        let mut guard = self
            .data
            .try_write()
            .map_err(|_| Error::new(ErrorKind::WouldBlock, "buffer in use"))?;
        window.read_at(0, &mut guard[..window.len()])
    }

    /// Address of the first byte in this process; stable for the buffer's lifetime.
    pub fn addr(&self) -> u64 {
        self.addr
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True for a zero-length buffer.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

/// Shared view of a [`Buffer`].
pub struct BufferRead<'a> {
    guard: RwLockReadGuard<'a, MmapMut>,
    len: usize,
}

impl std::ops::Deref for BufferRead<'_> {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        &self.guard[..self.len]
    }
}

/// Exclusive view of a [`Buffer`].
pub struct BufferWrite<'a> {
    guard: RwLockWriteGuard<'a, MmapMut>,
    len: usize,
}

impl std::ops::Deref for BufferWrite<'_> {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        &self.guard[..self.len]
    }
}

impl std::ops::DerefMut for BufferWrite<'_> {
    fn deref_mut(&mut self) -> &mut [u8] {
        &mut self.guard[..self.len]
    }
}

/// Memory that a transport can register: a file window or a buffer.
#[derive(Debug, Clone)]
pub enum Memory {
    /// A read-only file mapping.
    File(Arc<FileWindow>),
    /// Anonymous writable memory.
    Buffer(Arc<Buffer>),
}

impl Memory {
    /// Address of the first byte in this process.
    pub fn addr(&self) -> u64 {
        match self {
            Memory::File(f) => f.addr(),
            Memory::Buffer(b) => b.addr(),
        }
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        match self {
            Memory::File(f) => f.len(),
            Memory::Buffer(b) => b.len(),
        }
    }

    /// True if the memory is empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// True if the memory can take writes (only buffers can).
    pub fn is_writable(&self) -> bool {
        matches!(self, Memory::Buffer(_))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    #[test]
    fn file_window_maps_the_right_bytes() {
        let mut f = tempfile::tempfile().unwrap();
        let data: Vec<u8> = (0..3 * 4096).map(|i| (i % 251) as u8).collect();
        f.write_all(&data).unwrap();
        let w = FileWindow::map(&f, 4096, 100).unwrap();
        assert_eq!(w.bytes(), &data[4096..4196]);
        assert_eq!(w.offset(), 4096);
    }

    /// A three-page file of a known pattern, its bytes, and a window of its last two
    /// pages.
    fn patterned_window() -> (File, Vec<u8>, Arc<FileWindow>) {
        let mut f = tempfile::tempfile().unwrap();
        let data: Vec<u8> = (0..3 * 4096).map(|i| (i % 251) as u8).collect();
        f.write_all(&data).unwrap();
        let w = FileWindow::map(&f, 4096, 8192).unwrap();
        (f, data, w)
    }

    #[test]
    fn read_at_copies_without_touching_the_mapping() {
        let (f, data, w) = patterned_window();
        let mut got = vec![0u8; 100];
        w.read_at(10, &mut got).unwrap();
        assert_eq!(got, &data[4106..4206]);
        let mut past = vec![0u8; 2];
        assert_eq!(
            w.read_at(8191, &mut past).unwrap_err().kind(),
            std::io::ErrorKind::InvalidInput
        );
        // Truncated below the window: an error, not SIGBUS.
        f.set_len(4096 + 50).unwrap();
        assert_eq!(
            w.read_at(10, &mut got).unwrap_err().kind(),
            std::io::ErrorKind::UnexpectedEof
        );
        w.read_at(0, &mut got[..50]).unwrap();
        assert_eq!(&got[..50], &data[4096..4146]);
    }

    #[test]
    fn read_cached_at_reads_only_what_the_window_holds() {
        let (f, data, w) = patterned_window();
        let mut got = vec![0u8; 100];
        // Just written, so cached; a filesystem without RWF_NOWAIT says false.
        if w.read_cached_at(10, &mut got) {
            assert_eq!(got, &data[4106..4206]);
        }
        assert!(!w.read_cached_at(8191, &mut got[..2]), "past the window");
        assert!(
            !w.read_cached_at(usize::MAX, &mut got[..2]),
            "overflowing offset"
        );
        // Truncated below the window: false (the blocking path reports why).
        f.set_len(4096 + 50).unwrap();
        assert!(!w.read_cached_at(10, &mut got));
    }

    #[tokio::test]
    async fn try_read_fails_only_while_a_writer_holds_the_buffer() {
        let b = Buffer::new(4096).unwrap();
        assert_eq!(b.try_read().unwrap().len(), 4096);
        let w = b.write().await;
        assert!(b.try_read().is_none());
        drop(w);
        let _r1 = b.read().await;
        assert!(b.try_read().is_some(), "readers share");
    }

    #[tokio::test]
    async fn buffer_is_writable_and_zeroed() {
        let b = Buffer::new(10_000).unwrap();
        assert!(b.read().await.iter().all(|&x| x == 0));
        b.write().await[9_999] = 7;
        assert_eq!(b.read().await[9_999], 7);
        assert_eq!(b.read().await.len(), 10_000);
    }
}
