//! A journaled ext4 on a loop device, mounted for the length of a test, whose files'
//! bytes a test can damage underneath the file system: written to the block device
//! directly, so the file's inode, size, mtime and ctime stay as they were, as bit rot
//! leaves them.

use std::fs;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::Command;

use nix::mount::{umount2, MntFlags};
use tempfile::TempDir;

/// Block size the file system is made with (and the unit of its block map).
const BLOCK: u64 = 4096;

/// An ext4 image attached to a loop device and mounted; unmounted and detached on drop.
#[derive(Debug)]
pub struct LoopExt4 {
    /// Holds the image.
    _dir: TempDir,
    image: PathBuf,
    device: String,
    mountpoint: PathBuf,
}

/// Runs `cmd`; its stdout, or why it failed.
fn run(cmd: &mut Command) -> Result<String, String> {
    let out = cmd.output().map_err(|e| format!("{cmd:?}: {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "{cmd:?}: {}: {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

impl LoopExt4 {
    /// Makes a `size_mib` MiB ext4 (4 KiB blocks) in a sparse image, attaches it to a
    /// free loop device and mounts it on `mountpoint` (created if missing). Needs root,
    /// `losetup`, `mkfs.ext4` and `debugfs`; the error says what was missing.
    pub fn mount(mountpoint: &Path, size_mib: u64) -> Result<LoopExt4, String> {
        // Every tool `rot` needs, before anything is made.
        run(Command::new("debugfs").arg("-V"))?;
        run(Command::new("losetup").arg("--version"))?;
        let dir = tempfile::tempdir().map_err(|e| format!("temp dir: {e}"))?;
        let image = dir.path().join("fs.img");
        fs::File::create(&image)
            .and_then(|f| f.set_len(size_mib << 20))
            .map_err(|e| format!("image: {e}"))?;
        run(Command::new("mkfs.ext4")
            .args(["-q", "-F", "-b", "4096"])
            .arg(&image))?;
        let device = run(Command::new("losetup")
            .args(["--find", "--show"])
            .arg(&image))?
        .trim()
        .to_string();
        fs::create_dir_all(mountpoint).map_err(|e| format!("mkdir: {e}"))?;
        // Attached from here: dropping detaches, should the mount fail.
        let mut fs = LoopExt4 {
            _dir: dir,
            image,
            device,
            mountpoint: PathBuf::new(),
        };
        run(Command::new("mount").arg(&fs.device).arg(mountpoint))?;
        fs.mountpoint = mountpoint.to_path_buf();
        Ok(fs)
    }

    /// The mount point.
    pub fn path(&self) -> &Path {
        &self.mountpoint
    }

    /// Unmounts the file system and mounts it again from another loop device, as a
    /// remount, or a reboot that finds the disks in another order, brings a file
    /// system back: every inode, timestamp and byte as it was, under another device
    /// number. (The image is attached anew while the old device still holds it, so
    /// the new device cannot be the old one.) Nothing may hold the mount open. Panics
    /// unless the mount point's device number changed.
    pub fn remount_on_another_device(&mut self) {
        let before = fs::metadata(&self.mountpoint).unwrap().dev();
        let device = run(Command::new("losetup")
            .args(["--find", "--show"])
            .arg(&self.image))
        .unwrap()
        .trim()
        .to_string();
        umount2(&self.mountpoint, MntFlags::empty()).unwrap();
        let old = std::mem::replace(&mut self.device, device);
        run(Command::new("losetup").arg("-d").arg(&old)).unwrap();
        run(Command::new("mount")
            .arg(&self.device)
            .arg(&self.mountpoint))
        .unwrap();
        let after = fs::metadata(&self.mountpoint).unwrap().dev();
        assert_ne!(before, after, "mounted again under the same device number");
    }

    /// Flips every bit of the byte at `offset` of `file` (on this file system) on the
    /// block device, under the file system, after writing the file's dirty pages out;
    /// then drops the file's cached pages, so the next read comes from the device.
    /// Panics unless the file's metadata is unchanged and the damage is what a read of
    /// the file now returns (the fault fired).
    pub fn rot(&self, file: &Path, offset: u64) {
        let before = fs::metadata(file).unwrap();
        let original = fs::read(file).unwrap()[offset as usize];
        run(Command::new("sync").arg("-f").arg(file)).unwrap();
        // The physical block of the file's logical block, from the file system's own map.
        let map = run(Command::new("debugfs")
            .arg("-R")
            .arg(format!("bmap <{}> {}", before.ino(), offset / BLOCK))
            .arg(&self.device))
        .unwrap();
        let physical: u64 = map
            .trim()
            .parse()
            .unwrap_or_else(|_| panic!("debugfs bmap said {map:?}"));
        assert!(physical > 0, "no block mapped at offset {offset}");
        let block = tempfile::NamedTempFile::new().unwrap();
        run(Command::new("dd")
            .arg(format!("if={}", self.device))
            .arg(format!("of={}", block.path().display()))
            .args(["bs=4096", "count=1", "iflag=direct", "status=none"])
            .arg(format!("skip={physical}")))
        .unwrap();
        let mut bytes = fs::read(block.path()).unwrap();
        let at = (offset % BLOCK) as usize;
        assert_eq!(bytes[at], original, "the block map points elsewhere");
        bytes[at] = !bytes[at];
        fs::write(block.path(), &bytes).unwrap();
        run(Command::new("dd")
            .arg(format!("if={}", block.path().display()))
            .arg(format!("of={}", self.device))
            .args([
                "bs=4096",
                "count=1",
                "oflag=direct",
                "conv=notrunc",
                "status=none",
            ])
            .arg(format!("seek={physical}")))
        .unwrap();
        drop_cached_pages(file);
        let after = fs::metadata(file).unwrap();
        assert_eq!(
            (after.ino(), after.size(), after.mtime_nsec(), after.mtime()),
            (
                before.ino(),
                before.size(),
                before.mtime_nsec(),
                before.mtime()
            )
        );
        assert_eq!(
            (after.ctime(), after.ctime_nsec()),
            (before.ctime(), before.ctime_nsec())
        );
        assert_eq!(
            fs::read(file).unwrap()[offset as usize],
            !original,
            "the damage is not what the file reads back"
        );
        drop_cached_pages(file);
    }
}

/// Asks the kernel to drop `file`'s clean cached pages (no metadata change).
fn drop_cached_pages(file: &Path) {
    let f = fs::File::open(file).unwrap();
    nix::fcntl::posix_fadvise(
        std::os::fd::AsRawFd::as_raw_fd(&f),
        0,
        0,
        nix::fcntl::PosixFadviseAdvice::POSIX_FADV_DONTNEED,
    )
    .unwrap();
}

impl Drop for LoopExt4 {
    fn drop(&mut self) {
        if !self.mountpoint.as_os_str().is_empty() {
            if let Err(e) = umount2(&self.mountpoint, MntFlags::empty()) {
                eprintln!(
                    "umount {}: {e}; detaching lazily",
                    self.mountpoint.display()
                );
                let _ = umount2(&self.mountpoint, MntFlags::MNT_DETACH);
            }
        }
        let _ = Command::new("losetup").arg("-d").arg(&self.device).status();
    }
}
