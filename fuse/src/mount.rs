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
    let flags = MsFlags::MS_RDONLY | MsFlags::MS_NOSUID | MsFlags::MS_NODEV;
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
