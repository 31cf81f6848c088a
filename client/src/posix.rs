//! The `posix` capability on the client side: requests that act as a caller
//! ([`Request::AsCaller`]), special files ([`Client::make_node`]) and `utimensat`'s
//! `UTIME_NOW`/`UTIME_OMIT` ([`Client::set_times`]).
//!
//! Who a request acts as: the caller of the task that sends it ([`as_caller`], which a
//! mount sets around each kernel request with the calling process's ids), else the
//! process's caller if one was set ([`set_process_caller`], which `rcp` sets to its own
//! ids), else nobody (the request is sent unwrapped, and acts as the server's user
//! on a share whose owners are ferryd's, or as ferryd on any share). The wrap is made in
//! one place, [`Client::call`], on a session that negotiated `posix` only.

use std::future::Future;
use std::sync::OnceLock;

use ferry_common::msg::{
    Attr, Caller, NodeKind, Owner, Request, Response, TimeSet, CALLER_MAX_GROUPS,
};

use crate::client::unexpected;
use crate::{Client, ClientError};

tokio::task_local! {
    static CALLER: Caller;
}

static PROCESS_CALLER: OnceLock<Caller> = OnceLock::new();

/// Runs `fut` with every request it sends acting as `caller`.
pub async fn as_caller<F: Future>(caller: Caller, fut: F) -> F::Output {
    CALLER.scope(caller, fut).await
}

/// Makes requests sent outside any [`as_caller`] act as `caller` (once per process;
/// a later call changes nothing).
pub fn set_process_caller(caller: Caller) {
    let _ = PROCESS_CALLER.set(caller);
}

/// This process's ids: real uid, real gid and supplementary groups.
pub fn process_caller() -> Caller {
    let groups = nix::unistd::getgroups()
        .map(|g| g.into_iter().map(|g| g.as_raw()).collect())
        .unwrap_or_default();
    Caller {
        uid: nix::unistd::getuid().as_raw(),
        gid: nix::unistd::getgid().as_raw(),
        groups,
    }
}

/// The caller of thread `tid` as the kernel names it in a FUSE request: `uid`/`gid`
/// (its file-system ids) and the supplementary groups `/proc/<tid>/status` lists
/// (none if the process is gone).
pub fn caller_of(tid: u32, uid: u32, gid: u32) -> Caller {
    let status = std::fs::read_to_string(format!("/proc/{tid}/status")).unwrap_or_default();
    let groups = status
        .lines()
        .find_map(|l| l.strip_prefix("Groups:"))
        .map(|l| {
            l.split_whitespace()
                .filter_map(|g| g.parse().ok())
                .take(CALLER_MAX_GROUPS)
                .collect()
        })
        .unwrap_or_default();
    Caller { uid, gid, groups }
}

/// `req` as the current caller's, where the session negotiated `posix` and a caller is
/// known; else `req` itself.
pub(crate) fn wrap(client: &Client, req: Request) -> Request {
    if matches!(req, Request::Auth { .. } | Request::AsCaller { .. }) || !client.has_posix() {
        return req;
    }
    let caller = CALLER
        .try_with(Clone::clone)
        .ok()
        .or_else(|| PROCESS_CALLER.get().cloned());
    match caller {
        Some(caller) => Request::AsCaller {
            caller,
            request: Box::new(req),
        },
        None => req,
    }
}

impl Client {
    /// Whether the session negotiated the `posix` capability.
    pub fn has_posix(&self) -> bool {
        self.negotiated().is_some_and(|n| n.posix)
    }

    fn need_posix(&self) -> Result<(), ClientError> {
        if self.has_posix() {
            return Ok(());
        }
        Err(ClientError::Usage(
            "the server does not support special files and UTIME_NOW (no 'posix' capability)"
                .into(),
        ))
    }

    /// Makes the FIFO, socket or device node `path` (see [`Request::MakeNode`]).
    pub async fn make_node(
        &self,
        share: &str,
        path: &str,
        kind: NodeKind,
        mode: u32,
        rdev: u64,
    ) -> Result<(Attr, Owner), ClientError> {
        self.need_posix()?;
        let req = Request::MakeNode {
            share: share.into(),
            path: path.into(),
            kind,
            mode,
            rdev,
        };
        match self.call(req).await? {
            Response::AttrMeta { attr, owner } => Ok((attr, owner)),
            other => Err(unexpected(other)),
        }
    }

    /// Sets the times of `path` (see [`Request::SetTimes`]).
    pub async fn set_times(
        &self,
        share: &str,
        path: &str,
        atime: TimeSet,
        mtime: TimeSet,
    ) -> Result<Attr, ClientError> {
        self.need_posix()?;
        let req = Request::SetTimes {
            share: share.into(),
            path: path.into(),
            atime,
            mtime,
        };
        match self.call(req).await? {
            Response::Attr(a) => Ok(a),
            other => Err(unexpected(other)),
        }
    }
}

/// The caller of the current task, if [`as_caller`] set one.
pub fn current_caller() -> Option<Caller> {
    CALLER.try_with(Clone::clone).ok()
}
