//! Whose files a share's entries are: ferryd's (`owners = "server"`, the default), or
//! the clients' (`owners = "client"`), for a share used as a local file system by many
//! users.
//!
//! With client owners (and ferryd running as root, which the configuration checks), a
//! request a client wraps in `AsCaller` runs its file-system calls with the caller's
//! file-system uid and gid and supplementary groups, on the blocking thread that makes
//! them ([`spawn_blocking`]), so the server's kernel applies POSIX itself: owners of new
//! entries, set-group-ID directory inheritance, sticky directories, who may chown,
//! chmod and set which times, and the clearing of set-ID bits. With `root_squash` (the
//! default, as NFS), uid 0 acts as 65534/65534 (nobody/nogroup) without groups.
//!
//! Device nodes and set-user-ID/set-group-ID files from a caller are refused unless the
//! share allows them (`allow_devices`, `allow_setid`) and its file system is mounted
//! `nodev` (devices) or `nosuid` (set-ID bits), so that nothing a client makes acts on
//! the server. The check runs on the acting thread ([`check_node`], [`check_setid`]).
//!
//! Invariant: a thread acts as a caller only inside [`spawn_blocking`]'s closure; the
//! credential guard restores it before the thread serves anything else.

use std::cell::Cell;
use std::io;
use std::path::Path;

use ferry_common::msg::{Caller, NodeKind};
use ferry_common::transport::sys::creds;
use nix::sys::statvfs::{statvfs, FsFlags};
use serde::Deserialize;

/// The uid and gid root is squashed to (nobody, nogroup).
pub const SQUASHED_ID: u32 = 65_534;

/// Whose files a share's entries are.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Owners {
    /// ferryd's: every entry is made by ferryd's user, whoever the client.
    #[default]
    Server,
    /// The calling users' (numeric ids the client sends).
    Client,
}

/// A share's owner policy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OwnerPolicy {
    /// Whose files.
    pub owners: Owners,
    /// Uid 0 acts as [`SQUASHED_ID`].
    pub root_squash: bool,
    /// Callers may make device nodes (where the file system is `nodev`).
    pub allow_devices: bool,
    /// Callers may set set-user-ID and set-group-ID bits on files (where the file
    /// system is `nosuid`).
    pub allow_setid: bool,
}

impl Default for OwnerPolicy {
    fn default() -> OwnerPolicy {
        OwnerPolicy {
            owners: Owners::Server,
            root_squash: true,
            allow_devices: false,
            allow_setid: false,
        }
    }
}

/// Who a request's calls act as, and what the share lets it make.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Acting {
    uid: u32,
    gid: u32,
    groups: Vec<u32>,
    devices: bool,
    setid: bool,
}

impl OwnerPolicy {
    /// Who `caller` acts as on the share rooted at `root`; `None` where the share's
    /// owners are ferryd's (the request then runs as ferryd).
    pub fn acting(&self, caller: &Caller, root: &Path) -> Option<Acting> {
        if self.owners == Owners::Server {
            return None;
        }
        let flags = statvfs(root).map(|s| s.flags()).unwrap_or(FsFlags::empty());
        let (uid, gid, groups) = if self.root_squash && caller.uid == 0 {
            (SQUASHED_ID, SQUASHED_ID, Vec::new())
        } else {
            (caller.uid, caller.gid, caller.groups.clone())
        };
        Some(Acting {
            uid,
            gid,
            groups,
            devices: self.allow_devices && flags.contains(FsFlags::ST_NODEV),
            setid: self.allow_setid && flags.contains(FsFlags::ST_NOSUID),
        })
    }
}

tokio::task_local! {
    /// Who the current request task acts as (set around an `AsCaller` request).
    static ACTING: Acting;
}

thread_local! {
    /// What the acting caller of this thread may make: (devices, set-ID bits), and
    /// whether it is root.
    static ALLOWS: Cell<Option<(bool, bool, bool)>> = const { Cell::new(None) };
}

/// Runs `fut` acting as `acting` (every [`spawn_blocking`] it makes acts so).
pub async fn scope<F: std::future::Future>(acting: Acting, fut: F) -> F::Output {
    ACTING.scope(acting, fut).await
}

/// Runs `f` on tokio's blocking pool, acting as the current task's caller if it has
/// one (see the module docs); fails without running `f` where the kernel refuses the
/// ids.
pub fn spawn_blocking<T, F>(f: F) -> tokio::task::JoinHandle<io::Result<T>>
where
    T: Send + 'static,
    F: FnOnce() -> T + Send + 'static,
{
    let acting = ACTING.try_with(Clone::clone).ok();
    tokio::task::spawn_blocking(move || {
        let Some(a) = acting else {
            return Ok(f());
        };
        let _guard = creds::act_as(a.uid, a.gid, &a.groups)?;
        ALLOWS.with(|c| c.set(Some((a.devices, a.setid, a.uid == 0))));
        let out = f();
        ALLOWS.with(|c| c.set(None));
        Ok(out)
    })
}

/// What an acting caller may not make on its share.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum Refused {
    /// A device node.
    #[error("device nodes are refused: the share does not allow them (allow_devices) on a file system mounted nodev")]
    Device,
    /// A set-user-ID or set-group-ID file.
    #[error("set-user-ID and set-group-ID files are refused: the share does not allow them (allow_setid) on a file system mounted nosuid")]
    SetId,
}

/// Whether this thread's caller may make a node of `kind` (always, when not acting).
pub fn check_node(kind: NodeKind) -> Result<(), Refused> {
    let devices = ALLOWS.with(Cell::get).is_none_or(|(d, _, _)| d);
    match kind {
        NodeKind::Char | NodeKind::Block if !devices => Err(Refused::Device),
        _ => Ok(()),
    }
}

/// Whether this thread's caller may give a non-directory the permission bits `mode`
/// (always, when not acting).
pub fn check_setid(mode: u32) -> Result<(), Refused> {
    let setid = ALLOWS.with(Cell::get).is_none_or(|(_, s, _)| s);
    if mode & 0o6000 != 0 && !setid {
        return Err(Refused::SetId);
    }
    Ok(())
}

/// Whether this thread acts as a caller other than root, who may not give files
/// away: metadata batches then leave owners as they are, as rsync run by a user does.
pub fn acting_unprivileged() -> bool {
    ALLOWS.with(Cell::get).is_some_and(|(_, _, root)| !root)
}

/// Whether this thread acts as a caller (whose kernel rules then hold as they are:
/// nothing is put back after them).
pub fn acting() -> bool {
    creds::acting()
}
