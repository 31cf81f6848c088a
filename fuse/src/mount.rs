//! Mounting: as root, plain mount(2) of type `fuse.ferry` on an open `/dev/fuse`, so
//! the mount shows as `fuse.ferry` in `/proc/mounts` (as sshfs shows as `fuse.sshfs`);
//! otherwise fuser's own path through `fusermount3`.

use std::os::fd::{AsRawFd, OwnedFd};
use std::path::{Path, PathBuf};

use fuser::{Config, Filesystem, MountOption, Session, SessionACL};
use nix::mount::{MntFlags, MsFlags};

/// The filesystem type of a Ferry mount (the kernel's `fuse` plus a subtype).
pub const FS_TYPE: &str = "fuse.ferry";

/// What unmounts a mount made here.
pub enum Unmounter {
    /// Made by mount(2) here: umount2 on the path.
    Direct(PathBuf),
    /// Made by fuser (through fusermount3).
    Fuser(fuser::SessionUnmounter),
}

impl Unmounter {
    /// Unmounts; if the mount is busy, detaches it lazily (it goes once unused).
    pub fn unmount(&mut self) -> Result<(), String> {
        let first = match self {
            Unmounter::Direct(path) => {
                nix::mount::umount2(path.as_path(), MntFlags::empty()).map_err(|e| e.to_string())
            }
            Unmounter::Fuser(u) => u.unmount().map_err(|e| e.to_string()),
        };
        let Err(e) = first else { return Ok(()) };
        let path = match self {
            Unmounter::Direct(p) => p.clone(),
            Unmounter::Fuser(_) => return Err(e),
        };
        tracing::warn!("unmount failed ({e}); detaching the mount lazily");
        nix::mount::umount2(path.as_path(), MntFlags::MNT_DETACH).map_err(|e| e.to_string())
    }
}

/// Sets the kernel readahead of the mount at `mountpoint` (absolute, canonical) to
/// `kib` KiB through its backing device's `read_ahead_kb`. The kernel starts a FUSE
/// mount at 128 KiB, which keeps a sequential reader at one 128 KiB request in flight;
/// 1 MiB lets it send bigger, overlapping requests. Needs root; reads
/// `/proc/self/mountinfo` only, so it never calls into the mount itself.
pub fn set_readahead(mountpoint: &Path, kib: u32) -> Result<(), String> {
    let info = std::fs::read_to_string("/proc/self/mountinfo").map_err(|e| e.to_string())?;
    let want = mountpoint.to_string_lossy();
    // Fields: id parent major:minor root mountpoint ...; the last match is the newest.
    let dev = info
        .lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.split(' ').collect();
            (f.len() > 4 && f[4] == want).then(|| f[2].to_string())
        })
        .next_back()
        .ok_or_else(|| format!("{want} is not in /proc/self/mountinfo"))?;
    let knob = format!("/sys/class/bdi/{dev}/read_ahead_kb");
    std::fs::write(&knob, format!("{kib}\n")).map_err(|e| format!("{knob}: {e}"))
}

/// Mounts `fs` on `mountpoint` and does the FUSE handshake.
pub fn mount<FS: Filesystem>(
    fs: FS,
    mountpoint: &Path,
    fsname: &str,
    config: &Config,
) -> std::io::Result<(Session<FS>, Unmounter)> {
    let dev = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/fuse")?;
    let fd: OwnedFd = dev.into();
    let mut data = format!(
        "fd={},rootmode=40000,user_id={},group_id={}",
        fd.as_raw_fd(),
        nix::unistd::getuid(),
        nix::unistd::getgid()
    );
    if config.acl != SessionACL::Owner {
        data.push_str(",allow_other");
    }
    if config
        .mount_options
        .contains(&MountOption::DefaultPermissions)
    {
        data.push_str(",default_permissions");
    }
    let mut flags = MsFlags::MS_NOSUID | MsFlags::MS_NODEV;
    if config.mount_options.contains(&MountOption::RO) {
        flags |= MsFlags::MS_RDONLY;
    }
    match nix::mount::mount(
        Some(fsname),
        mountpoint,
        Some(FS_TYPE),
        flags,
        Some(data.as_str()),
    ) {
        Ok(()) => {
            let unmounter = Unmounter::Direct(mountpoint.to_path_buf());
            match Session::from_fd(fs, fd, config.acl, config.clone()) {
                Ok(session) => Ok((session, unmounter)),
                Err(e) => {
                    let _ = nix::mount::umount2(mountpoint, MntFlags::MNT_DETACH);
                    Err(e)
                }
            }
        }
        Err(nix::errno::Errno::EPERM) => {
            // Not root: fuser mounts through the setuid fusermount3.
            drop(fd);
            let mut session = Session::new(fs, mountpoint, config)?;
            let unmounter = Unmounter::Fuser(session.unmount_callable());
            Ok((session, unmounter))
        }
        Err(e) => Err(std::io::Error::other(format!("mount(2): {e}"))),
    }
}
