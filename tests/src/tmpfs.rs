//! Small tmpfs file systems for disk-full tests, unmounted on drop.

use std::fs;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use nix::mount::{mount, umount2, MntFlags, MsFlags};

/// A tmpfs of a fixed size mounted on a directory for the length of a test.
///
/// Dropping it unmounts it (lazily if something still uses it), also while a failing
/// test unwinds, so no mount outlives its test. Declare it after the [`crate::Env`]
/// whose directory it sits in, so it is dropped (unmounted) first.
#[derive(Debug)]
pub struct Tmpfs {
    path: PathBuf,
}

impl Tmpfs {
    /// Mounts a tmpfs of `size_bytes` (rounded up to pages by the kernel) on directory
    /// `path`, created if missing. Needs root (`CAP_SYS_ADMIN`); see [`Tmpfs::available`].
    pub fn mount(path: &Path, size_bytes: u64) -> Result<Tmpfs, String> {
        fs::create_dir_all(path).map_err(|e| format!("mkdir {}: {e}", path.display()))?;
        let options = format!("size={size_bytes},mode=0755");
        mount(
            Some("ferry-test"),
            path,
            Some("tmpfs"),
            MsFlags::MS_NOSUID | MsFlags::MS_NODEV,
            Some(options.as_str()),
        )
        .map_err(|e| format!("cannot mount a tmpfs on {}: {e}", path.display()))?;
        Ok(Tmpfs {
            path: path.to_path_buf(),
        })
    }

    /// Whether this process can mount a tmpfs (tried once on a scratch directory);
    /// the error says why not, for a test to print when it skips.
    pub fn available() -> Result<(), String> {
        static PROBE: OnceLock<Result<(), String>> = OnceLock::new();
        PROBE
            .get_or_init(|| {
                let dir = tempfile::tempdir().map_err(|e| format!("no temp dir: {e}"))?;
                Tmpfs::mount(dir.path(), 1 << 20).map(drop)
            })
            .clone()
    }

    /// The mount point.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Bytes still free on the file system (`statvfs`: available blocks).
    pub fn free_bytes(&self) -> u64 {
        let st = nix::sys::statvfs::statvfs(&self.path)
            .unwrap_or_else(|e| panic!("statvfs {}: {e}", self.path.display()));
        st.blocks_available() as u64 * st.fragment_size() as u64
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        if umount2(&self.path, MntFlags::empty()).is_ok() {
            return;
        }
        // Busy (a process still in it): detach now, the kernel frees it when unused.
        if let Err(e) = umount2(&self.path, MntFlags::MNT_DETACH) {
            eprintln!("cannot unmount the tmpfs on {}: {e}", self.path.display());
        }
    }
}

#[cfg(test)]
mod tests {
    use std::panic::{catch_unwind, AssertUnwindSafe};
    use std::sync::Mutex;

    use super::*;
    use crate::env::{Env, DEFAULT_SHARE};

    /// True if `/proc/self/mountinfo` lists a mount on `path`.
    fn is_mounted(path: &Path) -> bool {
        let info = fs::read_to_string("/proc/self/mountinfo").expect("read mountinfo");
        let want = path.to_string_lossy();
        info.lines()
            .any(|l| l.split(' ').nth(4).is_some_and(|m| m == want))
    }

    #[test]
    fn a_panicking_test_still_unmounts() {
        if let Err(why) = Tmpfs::available() {
            eprintln!("skipped: {why}");
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        let at = dir.path().join("m");
        let result = catch_unwind(|| {
            let tmpfs = Tmpfs::mount(&at, 1 << 20).unwrap();
            assert!(is_mounted(tmpfs.path()));
            fs::write(at.join("x"), b"x").unwrap();
            panic!("the test failed");
        });
        assert!(result.is_err());
        assert!(!is_mounted(&at));
        assert!(!at.join("x").exists());
    }

    #[test]
    fn an_env_unmounts_its_tmpfs_before_removing_its_dir() {
        if let Err(why) = Tmpfs::available() {
            eprintln!("skipped: {why}");
            return;
        }
        let seen = Mutex::new(None);
        let result = catch_unwind(AssertUnwindSafe(|| {
            let env = Env::builder().tmpfs(DEFAULT_SHARE, 1 << 20).start();
            assert!(is_mounted(&env.share_dir(DEFAULT_SHARE)));
            *seen.lock().unwrap() = Some((env.root().to_path_buf(), env.share_dir(DEFAULT_SHARE)));
            panic!("the test failed");
        }));
        assert!(result.is_err());
        let (root, share) = seen.into_inner().unwrap().expect("the env started");
        assert!(!is_mounted(&share));
        assert!(!root.exists(), "{} is left", root.display());
    }
}
