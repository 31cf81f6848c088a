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

/// A FUSE mount as `/proc/self/mountinfo` lists it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MountEntry {
    /// The mount's id (`mnt_id:` in `/proc/PID/fdinfo/FD` of its files).
    pub id: u64,
    /// Its device, `MAJOR:MINOR` (its backing device info in `/sys/class/bdi/`).
    pub dev: String,
}

/// The FUSE mount at `mountpoint` (absolute, canonical), the last one mounted there.
/// Reads `/proc/self/mountinfo` only, so it never calls into the mount itself.
pub fn fuse_mount_at(mountpoint: &Path) -> Result<MountEntry, String> {
    let info = std::fs::read_to_string("/proc/self/mountinfo").map_err(|e| e.to_string())?;
    parse_fuse_mount(&info, mountpoint).ok_or_else(|| {
        format!(
            "no FUSE mount at {} in /proc/self/mountinfo",
            mountpoint.display()
        )
    })
}

/// [`fuse_mount_at`] over the text of a mountinfo file.
fn parse_fuse_mount(info: &str, mountpoint: &Path) -> Option<MountEntry> {
    let want = mountpoint.as_os_str().as_encoded_bytes();
    // The last match is the newest mount there.
    info.lines().rev().find_map(|line| {
        // ID PARENT MAJ:MIN ROOT MOUNTPOINT OPTIONS [OPTIONAL...] - FSTYPE SOURCE ...
        let mut fields = line.split(' ');
        let id = fields.next()?.parse::<u64>().ok()?;
        let dev = fields.nth(1)?;
        let at = fields.nth(1)?;
        let fstype = line.split(" - ").nth(1)?.split(' ').next()?;
        (fstype.starts_with("fuse") && unescape_mountinfo(at) == want).then(|| MountEntry {
            id,
            dev: dev.to_string(),
        })
    })
}

/// A mountinfo path with its octal escapes (`\040` for a space...) undone.
fn unescape_mountinfo(field: &str) -> Vec<u8> {
    let b = field.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let octal = b
            .get(i + 1..i + 4)
            .filter(|d| b[i] == b'\\' && d.iter().all(|c| (b'0'..=b'7').contains(c)));
        match octal {
            Some(d) => {
                out.push(d.iter().fold(0u8, |v, c| v.wrapping_mul(8) + (c - b'0')));
                i += 4;
            }
            None => {
                out.push(b[i]);
                i += 1;
            }
        }
    }
    out
}

/// Sets the kernel readahead of the FUSE mount at `mountpoint` (absolute, canonical)
/// to `kib` KiB through its backing device's `read_ahead_kb`. The kernel starts a FUSE
/// mount at 128 KiB, which keeps a sequential reader at one 128 KiB request in flight;
/// 1 MiB lets it send bigger, overlapping requests. Needs root; never calls into the
/// mount itself.
pub fn set_readahead(mountpoint: &Path, kib: u32) -> Result<(), String> {
    let dev = fuse_mount_at(mountpoint)?.dev;
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_the_newest_fuse_mount_at_an_escaped_path() {
        let info = "\
22 1 0:21 / /proc rw,nosuid - proc proc rw
40 22 0:50 / /mnt/my\\040share rw,nosuid,nodev - fuse.ferry ferry rw,user_id=0
41 22 0:51 / /mnt/other rw - fuse.sshfs a@b:/ rw
42 40 8:1 / /mnt/my\\040share rw - ext4 /dev/sda1 rw
43 40 0:52 / /mnt/my\\040share rw,nosuid shared:7 - fuse.ferry ferry rw
";
        let at = Path::new("/mnt/my share");
        assert_eq!(
            parse_fuse_mount(info, at),
            Some(MountEntry {
                id: 43,
                dev: "0:52".into()
            })
        );
        assert_eq!(parse_fuse_mount(info, Path::new("/mnt/my\\040share")), None);
        assert_eq!(parse_fuse_mount(info, Path::new("/proc")), None);
        assert_eq!(
            parse_fuse_mount(info, Path::new("/mnt/other")).map(|m| m.id),
            Some(41)
        );
    }
}
