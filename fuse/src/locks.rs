//! File locks through the mount (`fcntl` record locks and `flock`): held by ferryd
//! for every client of the share (the `locks` capability), so a lock taken through
//! this mount excludes holders on every other mount.
//!
//! The kernel forwards `F_SETLK`, `F_SETLKW` and `F_GETLK` (and, with
//! `FUSE_FLOCK_LOCKS`, `flock` as a whole-file lock of the open file description)
//! with its lock owner. The server answers at once, granted or in the way; an
//! `F_SETLKW` is waited for here, asking again with a growing pause (at most
//! [`WAIT_MAX`]), until it is granted or the waiting thread has a signal pending
//! (then `EINTR`, as a local lock wait would give).
//!
//! What this mount remembers ([`Locks`]):
//! - per node, the server's identity of the file and the owners that hold locks on
//!   it, so a close (`FLUSH` for the owner's record locks, `RELEASE` for `flock`)
//!   releases exactly those, and only when there are any;
//! - per descriptor that took a lock, the connection it was taken on, while any owner
//!   holds locks on its node through this mount. The server drops a connection's
//!   locks when it ends, so after a reconnection such a descriptor would run unlocked:
//!   its reads, writes and locks fail with `EIO` instead, until it is closed. An owner
//!   that unlocks the whole file (SQLite at the end of each transaction) holds nothing
//!   there any more.
//!
//! Where the locks are held is a [`LockBackend`]: ferryd for a single server's share
//! ([`ServerLocks`], the connection is what they are held under), etcd for a cluster
//! share (`crate::cluster::locks`, under the mount's lease).

use std::collections::{HashMap, HashSet};
use std::future::Future;
use std::sync::Mutex;
use std::time::Duration;

use ferry_common::locks::{LockFile, LockHeld, LockKind};
use fuser::Errno;

use crate::remote::{lock, OpError, Remote};

/// Longest pause between two tries of a waiting `F_SETLKW`: how late at most a waiter
/// learns that the lock was released.
pub const WAIT_MAX: Duration = Duration::from_millis(50);

/// The end of a lock of the whole file as the kernel sends it (`OFFSET_MAX`).
const WHOLE_FILE_END: u64 = i64::MAX as u64;

/// First pause of a waiting `F_SETLKW`.
const WAIT_FIRST: Duration = Duration::from_millis(2);

/// A lock request as the kernel sends it.
#[derive(Debug, Clone, Copy)]
pub struct LockAsk {
    /// The node.
    pub ino: u64,
    /// The descriptor it came through.
    pub fh: u64,
    /// The kernel's lock owner.
    pub owner: u64,
    /// What is asked.
    pub kind: LockKind,
    /// First byte.
    pub start: u64,
    /// Last byte, inclusive.
    pub end: u64,
    /// The process, as `F_GETLK` elsewhere reports it.
    pub pid: u32,
}

struct NodeLocks {
    /// The connection (or lease) the locks were taken on.
    conn: u64,
    file: LockFile,
    /// The share path they were taken by (a cluster share's locks are named by it).
    path: String,
    owners: HashSet<u64>,
}

/// What a lock request left: what the lock is held under (a connection's or a lease's
/// id), the file's identity, and the lock of another owner in the way (then nothing
/// changed).
pub struct LockAnswer {
    /// The connection or lease.
    pub conn: u64,
    /// The file's identity where the locks are held.
    pub file: LockFile,
    /// The lock in the way, if any.
    pub conflict: Option<LockHeld>,
}

/// Where a mount's locks are held.
pub trait LockBackend {
    /// The id of the connection (or lease) locks are held under now; locks taken
    /// under another are gone.
    fn current(&self) -> Option<u64>;

    /// Takes, changes or drops `ask` on share path `path`; never waits.
    fn set(
        &self,
        path: &str,
        ask: LockAsk,
    ) -> impl Future<Output = Result<LockAnswer, OpError>> + Send;

    /// The lock of another owner in the way of `ask`, if any.
    fn test(
        &self,
        path: &str,
        ask: LockAsk,
    ) -> impl Future<Output = Result<Option<LockHeld>, OpError>> + Send;

    /// Drops every lock `owner` took on `file` (at `path`) under `conn`, which is the
    /// current one.
    fn release(
        &self,
        conn: u64,
        file: LockFile,
        path: &str,
        owner: u64,
    ) -> impl Future<Output = Result<(), OpError>> + Send;
}

/// The locks of a single server's share: ferryd holds them per connection.
pub struct ServerLocks<'a> {
    /// The server.
    pub remote: &'a Remote,
    /// The share.
    pub share: &'a str,
}

impl LockBackend for ServerLocks<'_> {
    fn current(&self) -> Option<u64> {
        self.remote.current().map(|c| c.id)
    }

    async fn set(&self, path: &str, ask: LockAsk) -> Result<LockAnswer, OpError> {
        let share = self.share;
        let range = (ask.start, ask.end);
        self.remote
            .call(&format!("lock {share}/{path}"), |c| async move {
                let a = c
                    .client
                    .lock(share, path, ask.owner, ask.kind, range, ask.pid)
                    .await?;
                Ok(LockAnswer {
                    conn: c.id,
                    file: a.file,
                    conflict: a.conflict,
                })
            })
            .await
    }

    async fn test(&self, path: &str, ask: LockAsk) -> Result<Option<LockHeld>, OpError> {
        let share = self.share;
        let range = (ask.start, ask.end);
        let answer = self
            .remote
            .call(&format!("lock test {share}/{path}"), |c| async move {
                c.client
                    .lock_test(share, path, ask.owner, ask.kind, range)
                    .await
            })
            .await?;
        Ok(answer.conflict)
    }

    async fn release(
        &self,
        _conn: u64,
        file: LockFile,
        _path: &str,
        owner: u64,
    ) -> Result<(), OpError> {
        let share = self.share;
        self.remote
            .call("unlock at close", |c| async move {
                c.client.lock_release(share, file, owner).await
            })
            .await
    }
}

/// What this mount holds; see the module docs.
#[derive(Default)]
pub struct Locks {
    nodes: Mutex<HashMap<u64, NodeLocks>>,
    /// Descriptors that took a lock while their node has locks here: the connection
    /// they took it on, and the node.
    fhs: Mutex<HashMap<u64, (u64, u64)>>,
}

/// The lock kind of an `fcntl` lock type.
pub fn kind_of(typ: i32) -> Result<LockKind, OpError> {
    match typ {
        nix::libc::F_RDLCK => Ok(LockKind::Read),
        nix::libc::F_WRLCK => Ok(LockKind::Write),
        nix::libc::F_UNLCK => Ok(LockKind::Unlock),
        other => Err(OpError::new(
            Errno::EINVAL,
            format!("unknown lock type {other}"),
        )),
    }
}

/// The `fcntl` lock type of a lock kind.
pub fn type_of(kind: LockKind) -> i32 {
    match kind {
        LockKind::Read => nix::libc::F_RDLCK,
        LockKind::Write => nix::libc::F_WRLCK,
        LockKind::Unlock => nix::libc::F_UNLCK,
    }
}

impl Locks {
    /// No locks.
    pub fn new() -> Locks {
        Locks::default()
    }

    /// Whether descriptor `fh` took locks on a connection that is gone (`current` is
    /// the live one's id): its I/O must fail rather than run unlocked.
    pub fn lost(&self, fh: u64, current: impl FnOnce() -> Option<u64>) -> bool {
        let taken_on = lock(&self.fhs).get(&fh).map(|&(conn, _)| conn);
        taken_on.is_some_and(|conn| Some(conn) != current())
    }

    /// Whether `owner` holds locks on node `ino` through this mount.
    pub fn holds(&self, ino: u64, owner: u64) -> bool {
        lock(&self.nodes)
            .get(&ino)
            .is_some_and(|n| n.owners.contains(&owner))
    }

    /// The descriptor is closed: it no longer answers for locks.
    pub fn forget_fh(&self, fh: u64) {
        lock(&self.fhs).remove(&fh);
    }

    /// Takes, changes or drops a lock on `path` (share-relative) as `ask` says, waiting
    /// while another owner holds it if `waiter` (the asking thread) is given.
    pub async fn set(
        &self,
        backend: &impl LockBackend,
        path: &str,
        ask: LockAsk,
        waiter: Option<u32>,
    ) -> Result<(), OpError> {
        let mut pause = WAIT_FIRST;
        loop {
            let answer = backend.set(path, ask).await.map_err(no_locks)?;
            let Some(held) = answer.conflict else {
                if ask.kind != LockKind::Unlock {
                    self.granted(ask, answer.conn, answer.file, path);
                } else if ask.start == 0 && ask.end >= WHOLE_FILE_END {
                    // The owner holds nothing on the file any more.
                    self.forget_owner(ask.ino, ask.owner);
                }
                return Ok(());
            };
            let Some(tid) = waiter else {
                return Err(in_the_way(path, &held));
            };
            if signal_pending(tid) {
                return Err(OpError::new(
                    Errno::EINTR,
                    format!("lock {path}: interrupted while waiting"),
                ));
            }
            tokio::time::sleep(pause).await;
            pause = (pause * 2).min(WAIT_MAX);
        }
    }

    /// The lock of another owner that would stop `ask`, if any.
    pub async fn test(
        &self,
        backend: &impl LockBackend,
        path: &str,
        ask: LockAsk,
    ) -> Result<Option<LockHeld>, OpError> {
        backend.test(path, ask).await.map_err(no_locks)
    }

    /// Releases every lock `owner` holds on node `ino` (a close), if it holds any
    /// under the backend's current connection or lease.
    pub async fn release(&self, backend: &impl LockBackend, ino: u64, owner: u64) {
        let Some((conn, file, path)) = self.forget_owner(ino, owner) else {
            return;
        };
        // Locks of a connection (or lease) that is gone went with it.
        if backend.current() != Some(conn) {
            return;
        }
        if let Err(e) = backend.release(conn, file, &path, owner).await {
            // The connection's (or lease's) end releases them if the server is gone.
            tracing::warn!("cannot release the locks of a closed file: {}", e.message);
        }
    }

    /// Forgets that `owner` holds locks on node `ino`; once no owner does, the node's
    /// descriptors have nothing to lose. Returns the connection, file and path it held
    /// them on, if it held any.
    fn forget_owner(&self, ino: u64, owner: u64) -> Option<(u64, LockFile, String)> {
        let mut nodes = lock(&self.nodes);
        let n = nodes.get_mut(&ino)?;
        if !n.owners.remove(&owner) {
            return None;
        }
        let held = (n.conn, n.file, n.path.clone());
        if n.owners.is_empty() {
            nodes.remove(&ino);
            lock(&self.fhs).retain(|_, &mut (_, node)| node != ino);
        }
        Some(held)
    }

    fn granted(&self, ask: LockAsk, conn: u64, file: LockFile, path: &str) {
        lock(&self.fhs).insert(ask.fh, (conn, ask.ino));
        let mut nodes = lock(&self.nodes);
        let n = nodes.entry(ask.ino).or_insert_with(|| NodeLocks {
            conn,
            file,
            path: path.to_owned(),
            owners: HashSet::new(),
        });
        if n.conn != conn || n.file != file {
            // Taken on an earlier connection (lost with it), or of a file the node's
            // name no longer holds: only the new lock counts.
            n.conn = conn;
            n.file = file;
            n.path = path.to_owned();
            n.owners.clear();
        }
        n.owners.insert(ask.owner);
    }
}

/// The lock request of a FUSE `getlk` or `setlk`; `EINVAL` for an unknown lock type.
pub fn ask_of(
    (ino, fh, owner): (u64, u64, u64),
    (start, end): (u64, u64),
    typ: i32,
    pid: u32,
) -> Result<LockAsk, Errno> {
    Ok(LockAsk {
        ino,
        fh,
        owner,
        kind: kind_of(typ).map_err(|e| e.errno)?,
        start,
        end,
        pid,
    })
}

/// Answers a `getlk` for `ask` with what the test found.
pub fn answer_getlk(reply: fuser::ReplyLock, ask: LockAsk, got: Result<Option<LockHeld>, OpError>) {
    match got {
        Ok(Some(h)) => reply.locked(h.start, h.end.min(WHOLE_FILE_END), type_of(h.kind), h.pid),
        Ok(None) => reply.locked(ask.start, ask.end, nix::libc::F_UNLCK, 0),
        Err(e) => {
            tracing::warn!("getlk: {}", e.message);
            reply.error(e.errno)
        }
    }
}

/// Answers a `setlk`: contention and interruption are the normal course of locking,
/// logged only for debugging.
pub fn answer_setlk(reply: fuser::ReplyEmpty, got: Result<(), OpError>) {
    match got {
        Ok(()) => reply.ok(),
        Err(e) if e.errno == Errno::EAGAIN || e.errno == Errno::EINTR => {
            tracing::debug!("setlk: {}", e.message);
            reply.error(e.errno)
        }
        Err(e) => {
            tracing::warn!("setlk: {}", e.message);
            reply.error(e.errno)
        }
    }
}

/// The error for a lock another owner holds (`F_SETLK`, `flock(LOCK_NB)`).
fn in_the_way(path: &str, held: &LockHeld) -> OpError {
    OpError::new(
        Errno::EAGAIN,
        format!(
            "lock {path}: bytes {}..={} are locked by process {} elsewhere",
            held.start, held.end, held.pid
        ),
    )
}

/// A lock request's failure as `fcntl` reports it: a server out of room for locks
/// (or without them) is `ENOLCK`.
fn no_locks(e: OpError) -> OpError {
    if e.errno == Errno::EBUSY {
        OpError::new(Errno::ENOLCK, e.message)
    } else {
        e
    }
}

/// Whether thread `tid` has a signal pending that it does not block (or is gone): a
/// lock wait it is in must end with `EINTR`. Read from `/proc/<tid>/status`
/// (`SigPnd`: the thread's, `ShdPnd`: its process's, `SigBlk`: blocked).
pub fn signal_pending(tid: u32) -> bool {
    let Ok(status) = std::fs::read_to_string(format!("/proc/{tid}/status")) else {
        return true;
    };
    let field = |name: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| u64::from_str_radix(v.trim(), 16).ok())
            .unwrap_or(0)
    };
    let pending = field("SigPnd:") | field("ShdPnd:");
    pending & !field("SigBlk:") != 0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lock_types_map_both_ways() {
        for kind in [LockKind::Read, LockKind::Write, LockKind::Unlock] {
            assert_eq!(kind_of(type_of(kind)).unwrap(), kind);
        }
        assert_eq!(kind_of(77).unwrap_err().errno, Errno::EINVAL);
    }

    #[test]
    fn this_thread_has_no_signal_pending_and_a_gone_one_counts_as_interrupted() {
        assert!(!signal_pending(std::process::id()));
        assert!(signal_pending(u32::MAX));
    }

    #[test]
    fn only_descriptors_locked_on_another_connection_are_lost() {
        let locks = Locks::new();
        let ask = LockAsk {
            ino: 5,
            fh: 9,
            owner: 1,
            kind: LockKind::Write,
            start: 0,
            end: 0,
            pid: 1,
        };
        locks.granted(ask, 3, LockFile { dev: 1, ino: 2 }, "f");
        assert!(!locks.lost(9, || Some(3)));
        assert!(locks.lost(9, || Some(4)));
        assert!(locks.lost(9, || None));
        assert!(!locks.lost(8, || Some(4)));
        locks.forget_fh(9);
        assert!(!locks.lost(9, || Some(4)));
        // An owner that dropped all it held leaves nothing to lose.
        locks.granted(ask, 3, LockFile { dev: 1, ino: 2 }, "f");
        assert!(locks.holds(5, 1));
        assert_eq!(
            locks.forget_owner(5, 1),
            Some((3, LockFile { dev: 1, ino: 2 }, "f".to_owned()))
        );
        assert!(!locks.holds(5, 1));
        assert!(!locks.lost(9, || Some(4)));
        assert_eq!(locks.forget_owner(5, 1), None);
    }
}
