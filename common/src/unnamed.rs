//! Files written whole before they have a name: the small files of a batch.
//!
//! A batch's file is written, made durable (a group commit) and only then given its
//! final name. Where the filesystem has them, the file is an unnamed inode in its
//! final directory (`open(2)` with `O_TMPFILE`), named at the end by one `linkat(2)`;
//! elsewhere it is a hidden scratch file next to its final name
//! ([`scratch_path`]), named by `rename(2)`, as before.
//!
//! Why: on ext4 a scratch name costs a directory entry made at `open` and a lookup, a
//! removal and a new entry at `rename`; an unnamed inode costs one new entry at
//! `linkat`: about 10 % less system time per file on a fresh journaled ext4, a few
//! per cent of ferryd's CPU on a mixed tree (docs/performance.md, "Unnamed files").
//! A copy killed before the link leaves nothing behind: the kernel frees an unnamed
//! inode when its last descriptor closes, and ext4 frees it at mount after a crash
//! (its orphan list).
//!
//! Invariants:
//! - A file is never visible under any name before [`Unnamed::name`], when it is
//!   linked (or renamed) straight to its final name: what has the final name is whole.
//! - [`Unnamed::name`] replaces whatever is at the final name as `rename(2)` does (a
//!   file or symlink is replaced, a directory is not: `EISDIR`), so callers keep one
//!   error handling for both kinds.
//! - An unnamed inode is made only where it can be named: `linkat` of
//!   `/proc/self/fd/N` with `AT_SYMLINK_FOLLOW`, which needs `/proc` and no privilege
//!   (checked once per process, [`can_link_unnamed`]).

use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use nix::errno::Errno;
use nix::fcntl::AtFlags;
use nix::unistd::linkat;

use crate::staging::{remove_quietly, scratch_path};

/// A file being written, before it has its final name.
#[derive(Debug)]
pub struct Unnamed {
    file: File,
    /// The hidden name it has meanwhile, where the filesystem could not make it
    /// unnamed.
    scratch: Option<PathBuf>,
}

impl Unnamed {
    /// Creates an empty file (mode 0600) to be named `final_path` later: an unnamed
    /// inode in `final_path`'s directory where the filesystem allows one, else a new
    /// hidden scratch file next to it (never through a symlink). Blocking.
    pub fn create(final_path: &Path) -> io::Result<Unnamed> {
        Unnamed::create_as(final_path, can_link_unnamed())
    }

    /// An empty unnamed file (mode 0600) in `final_path`'s directory, to be named
    /// `final_path` later; `None` where the filesystem, the kernel or this process
    /// cannot make one (the caller then names its file its own way). Blocking.
    pub fn create_unnamed(final_path: &Path) -> io::Result<Option<Unnamed>> {
        if !can_link_unnamed() {
            return Ok(None);
        }
        let dir = match final_path.parent() {
            Some(p) if !p.as_os_str().is_empty() => p,
            _ => Path::new("."),
        };
        match OpenOptions::new()
            .write(true)
            .mode(0o600)
            .custom_flags(nix::libc::O_TMPFILE)
            .open(dir)
        {
            Ok(file) => Ok(Some(Unnamed {
                file,
                scratch: None,
            })),
            // The filesystem (or kernel) has no unnamed files.
            Err(e) if no_tmpfile(&e) => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// [`Unnamed::create`], unnamed only if `unnamed`.
    fn create_as(final_path: &Path, unnamed: bool) -> io::Result<Unnamed> {
        if unnamed {
            if let Some(u) = Unnamed::create_unnamed(final_path)? {
                return Ok(u);
            }
        }
        let scratch = scratch_path(final_path);
        let file = OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .custom_flags(nix::libc::O_NOFOLLOW)
            .open(&scratch)?;
        Ok(Unnamed {
            file,
            scratch: Some(scratch),
        })
    }

    /// The file, to write and flush.
    pub fn file(&self) -> &File {
        &self.file
    }

    /// The file, to write.
    pub fn file_mut(&mut self) -> &mut File {
        &mut self.file
    }

    /// True if the file has a (hidden) name meanwhile.
    #[cfg(test)]
    fn is_scratch(&self) -> bool {
        self.scratch.is_some()
    }

    /// Gives the file the name `final_path`, replacing what is there as `rename(2)`
    /// does. An unnamed file is linked there; where a name is already taken, it is
    /// linked to a scratch name first and renamed over it. On failure nothing is left
    /// under a new name (the file can be named again or dropped). Blocking.
    pub fn name(&mut self, final_path: &Path) -> io::Result<()> {
        if let Some(scratch) = &self.scratch {
            std::fs::rename(scratch, final_path)?;
            self.scratch = None;
            return Ok(());
        }
        match self.link(final_path) {
            Ok(()) => return Ok(()),
            Err(Errno::EEXIST) => {}
            Err(e) => return Err(e.into()),
        }
        // Something has the name: a scratch name, then a rename over it (which
        // replaces a file or symlink and refuses a directory, EISDIR).
        let scratch = scratch_path(final_path);
        self.link(&scratch)?;
        if let Err(e) = std::fs::rename(&scratch, final_path) {
            remove_quietly(&scratch);
            return Err(e);
        }
        Ok(())
    }

    /// Drops the file: an unnamed one goes with its descriptor, a scratch name is
    /// removed. Blocking.
    pub fn discard(self) {
        if let Some(scratch) = &self.scratch {
            remove_quietly(scratch);
        }
    }

    /// `linkat` of the unnamed file to `to` (which must not exist).
    fn link(&self, to: &Path) -> Result<(), Errno> {
        let fd = PathBuf::from(format!("/proc/self/fd/{}", self.file.as_raw_fd()));
        linkat(None, fd.as_path(), None, to, AtFlags::AT_SYMLINK_FOLLOW)
    }
}

/// True if `e`, from an `O_TMPFILE` open, says the filesystem or kernel cannot make
/// unnamed files (where a named file would do).
fn no_tmpfile(e: &io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(nix::libc::EOPNOTSUPP | nix::libc::EISDIR | nix::libc::EINVAL)
    )
}

/// True if this process can name an unnamed file: `/proc/self/fd` is there to link
/// from. Checked once.
pub fn can_link_unnamed() -> bool {
    static CAN: OnceLock<bool> = OnceLock::new();
    *CAN.get_or_init(|| Path::new("/proc/self/fd").is_dir())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    fn names(dir: &Path) -> Vec<String> {
        let mut v: Vec<String> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        v.sort();
        v
    }

    /// Both kinds: unnamed (where this test's filesystem has them) and scratch.
    const KINDS: [bool; 2] = [true, false];

    #[test]
    fn a_file_has_no_name_until_it_is_named_whole() {
        for unnamed in KINDS {
            let dir = tempfile::tempdir().unwrap();
            let dest = dir.path().join("f");
            let mut u = Unnamed::create_as(&dest, unnamed).unwrap();
            u.file_mut().write_all(b"whole").unwrap();
            if unnamed && !u.is_scratch() {
                assert!(
                    names(dir.path()).is_empty(),
                    "an unnamed file shows no name"
                );
            } else {
                assert_eq!(names(dir.path()).len(), 1, "a scratch name meanwhile");
            }
            u.name(&dest).unwrap();
            assert_eq!(std::fs::read(&dest).unwrap(), b"whole");
            assert_eq!(names(dir.path()), ["f"]);
        }
    }

    #[test]
    fn the_test_filesystem_has_unnamed_files() {
        // Else the tests above would only cover scratch names.
        let dir = tempfile::tempdir().unwrap();
        let u = Unnamed::create(&dir.path().join("f")).unwrap();
        assert!(
            !u.is_scratch(),
            "O_TMPFILE and /proc/self/fd are there on Linux"
        );
    }

    #[test]
    fn naming_replaces_a_file_and_a_symlink_but_not_a_directory() {
        for unnamed in KINDS {
            replaces(unnamed);
        }
    }

    fn replaces(unnamed: bool) {
        let dir = tempfile::tempdir().unwrap();
        let dest = dir.path().join("f");
        std::fs::write(&dest, b"old").unwrap();
        let mut u = Unnamed::create_as(&dest, unnamed).unwrap();
        u.file_mut().write_all(b"new").unwrap();
        u.name(&dest).unwrap();
        assert_eq!(std::fs::read(&dest).unwrap(), b"new");

        // A symlink is replaced itself, never followed.
        let victim = dir.path().join("victim");
        std::fs::write(&victim, b"keep").unwrap();
        let link = dir.path().join("l");
        std::os::unix::fs::symlink(&victim, &link).unwrap();
        let mut u = Unnamed::create_as(&link, unnamed).unwrap();
        u.file_mut().write_all(b"file").unwrap();
        u.name(&link).unwrap();
        assert!(std::fs::symlink_metadata(&link).unwrap().is_file());
        assert_eq!(std::fs::read(&victim).unwrap(), b"keep");

        // A directory stays, and no scratch name is left beside it.
        let sub = dir.path().join("d");
        std::fs::create_dir(&sub).unwrap();
        let mut u = Unnamed::create_as(&sub, unnamed).unwrap();
        let e = u.name(&sub).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(nix::libc::EISDIR));
        u.discard();
        assert_eq!(names(dir.path()), ["d", "f", "l", "victim"]);
    }

    #[test]
    fn a_discarded_file_leaves_nothing() {
        for unnamed in KINDS {
            let dir = tempfile::tempdir().unwrap();
            let u = Unnamed::create_as(&dir.path().join("f"), unnamed).unwrap();
            u.discard();
            assert!(names(dir.path()).is_empty());
        }
    }
}
