//! Opening a name relative to a directory descriptor (`openat(2)`) as an owned
//! [`File`], which nix 0.29 returns only as a raw descriptor.
//!
//! ferryd resolves a share path's parent directory once, keeps it open, and then
//! names entries relative to it, so that nothing on the way can be swapped for a
//! symlink between the check and the use.

use std::ffi::CStr;
use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd};

use nix::fcntl::OFlag;
use nix::sys::stat::Mode;

/// Opens `name` (one component) in the directory `dir` with `flags` (`O_CLOEXEC` is
/// added) and no creation mode. With `O_PATH | O_NOFOLLOW` this is a handle on the
/// entry itself (a symlink is not followed), usable with `fstat` and as the directory
/// of further `*at` calls; it needs search permission on `dir` only. Blocking.
pub fn open_at(dir: &File, name: &CStr, flags: OFlag) -> io::Result<File> {
    open_at_mode(dir, name, flags, Mode::empty())
}

/// [`open_at`] with a creation `mode` (used with `O_CREAT`; the umask applies).
/// Blocking.
pub fn open_at_mode(dir: &File, name: &CStr, flags: OFlag, mode: Mode) -> io::Result<File> {
    let fd = nix::fcntl::openat(Some(dir.as_raw_fd()), name, flags | OFlag::O_CLOEXEC, mode)?;
    // SAFETY: `fd` was just returned by a successful openat, so it is an open
    // descriptor that nothing else owns; the File takes sole ownership and closes it
    // on drop.
    Ok(unsafe { File::from_raw_fd(fd) })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fs::OpenOptions;
    use std::os::unix::fs::{symlink, OpenOptionsExt};

    fn path_flags() -> OFlag {
        OFlag::O_PATH | OFlag::O_NOFOLLOW
    }

    #[test]
    fn opens_entries_of_a_directory_without_following_a_final_symlink() {
        let tmp = tempfile::tempdir().unwrap();
        std::fs::create_dir(tmp.path().join("d")).unwrap();
        std::fs::write(tmp.path().join("d/f"), b"x").unwrap();
        symlink("f", tmp.path().join("d/l")).unwrap();
        let root = OpenOptions::new()
            .read(true)
            .custom_flags(nix::libc::O_PATH | nix::libc::O_DIRECTORY)
            .open(tmp.path())
            .unwrap();
        let d = open_at(&root, c"d", path_flags() | OFlag::O_DIRECTORY).unwrap();
        assert!(d.metadata().unwrap().is_dir());
        let f = open_at(&d, c"f", path_flags()).unwrap();
        assert!(f.metadata().unwrap().is_file());
        // The link itself, not its target.
        let l = open_at(&d, c"l", path_flags()).unwrap();
        assert!(l.metadata().unwrap().file_type().is_symlink());
        // A symlink is never opened as a directory.
        symlink("d", tmp.path().join("dl")).unwrap();
        let e = open_at(&root, c"dl", path_flags() | OFlag::O_DIRECTORY).unwrap_err();
        assert!(
            matches!(
                e.raw_os_error(),
                Some(nix::libc::ELOOP | nix::libc::ENOTDIR)
            ),
            "{e}"
        );
        let e = open_at(&d, c"missing", path_flags()).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::NotFound);
    }
}
