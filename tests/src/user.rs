//! Running `ferryd` and `rcp` as an unprivileged user, for permission tests.
//!
//! The suite runs as root, and permission bits do not stop root: a `chmod 000` file is
//! still readable. Permission tests therefore run the program under test with the
//! uid and gid of `nobody` (65534) and no supplementary groups, set by the spawning
//! [`Command`] itself, so no `setpriv`/`runuser` and no passwd entry are needed.

use std::fs;
use std::os::unix::fs::{chown, PermissionsExt};
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::OnceLock;

use crate::server::bin;

/// The uid and gid of `nobody`/`nogroup` on Linux.
const NOBODY: u32 = 65534;

/// A uid and gid to run a program as; supplementary groups are dropped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct User {
    /// The user id.
    pub uid: u32,
    /// The group id.
    pub gid: u32,
}

impl User {
    /// `nobody` (65534:65534), when the tests run as root and the Ferry binaries can be
    /// run as that user (their directory is reachable); else why not, for a test to
    /// print when it skips. Probed once.
    pub fn unprivileged() -> Result<User, String> {
        static PROBE: OnceLock<Result<User, String>> = OnceLock::new();
        PROBE.get_or_init(probe).clone()
    }

    /// Makes `cmd` run as this user, without supplementary groups (std drops them when
    /// a root parent sets the uid).
    pub fn apply(&self, cmd: &mut Command) {
        cmd.uid(self.uid).gid(self.gid);
    }

    /// Gives `path` to this user (`chown`; not recursive, so what it holds keeps its
    /// owner).
    pub fn own(&self, path: &Path) {
        chown(path, Some(self.uid), Some(self.gid))
            .unwrap_or_else(|e| panic!("chown {}: {e}", path.display()));
    }
}

/// Lets every user reach (search, list) directory `path`: adds `r-x` for group and
/// others. Temp dirs are created `0700`, which would stop an unprivileged program at
/// the door.
pub(crate) fn open_dir_to_all(path: &Path) {
    let mode = fs::metadata(path)
        .unwrap_or_else(|e| panic!("stat {}: {e}", path.display()))
        .permissions()
        .mode();
    fs::set_permissions(path, fs::Permissions::from_mode((mode & 0o7777) | 0o055))
        .unwrap_or_else(|e| panic!("chmod {}: {e}", path.display()));
}

fn probe() -> Result<User, String> {
    if !nix::unistd::geteuid().is_root() {
        return Err("the tests do not run as root, so they cannot switch to another user".into());
    }
    let user = User {
        uid: NOBODY,
        gid: NOBODY,
    };
    for name in ["rcp", "ferryd"] {
        let mut cmd = Command::new(bin(name));
        cmd.arg("--version")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        user.apply(&mut cmd);
        match cmd.status() {
            Ok(s) if s.success() => {}
            Ok(s) => {
                return Err(format!(
                    "`{name} --version` as uid {NOBODY} exited with {s}"
                ))
            }
            Err(e) => return Err(format!("cannot run {name} as uid {NOBODY}: {e}")),
        }
    }
    Ok(user)
}
