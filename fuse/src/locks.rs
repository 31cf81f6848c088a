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

use std::collections::{HashMap, HashSet};
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
    /// The connection the locks were taken on.
    conn: u64,
    file: LockFile,
    owners: HashSet<u64>,
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
        remote: &Remote,
        share: &str,
        path: &str,
        ask: LockAsk,
        waiter: Option<u32>,
    ) -> Result<(), OpError> {
        let mut pause = WAIT_FIRST;
        loop {
            let (conn, answer) = remote
                .call(&format!("lock {share}/{path}"), |c| async move {
                    let id = c.id;
                    let a = c
                        .client
                        .lock(
                            share,
                            path,
                            ask.owner,
                            ask.kind,
                            (ask.start, ask.end),
                            ask.pid,
                        )
                        .await?;
                    Ok((id, a))
                })
                .await
                .map_err(no_locks)?;
            let Some(held) = answer.conflict else {
                if ask.kind != LockKind::Unlock {
                    self.granted(ask, conn, answer.file);
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
                    format!("lock {share}/{path}: interrupted while waiting"),
                ));
            }
            tokio::time::sleep(pause).await;
            pause = (pause * 2).min(WAIT_MAX);
        }
    }

    /// The lock of another owner that would stop `ask`, if any.
    pub async fn test(
        &self,
        remote: &Remote,
        share: &str,
        path: &str,
        ask: LockAsk,
    ) -> Result<Option<LockHeld>, OpError> {
        let answer = remote
            .call(&format!("lock test {share}/{path}"), |c| async move {
                c.client
                    .lock_test(share, path, ask.owner, ask.kind, (ask.start, ask.end))
                    .await
            })
            .await
            .map_err(no_locks)?;
        Ok(answer.conflict)
    }

    /// Releases every lock `owner` holds on node `ino` (a close), if it holds any on
    /// the live connection.
    pub async fn release(&self, remote: &Remote, share: &str, ino: u64, owner: u64) {
        let Some((conn, file)) = self.forget_owner(ino, owner) else {
            return;
        };
        // Locks of a connection that is gone went with it.
        if remote.current().map(|c| c.id) != Some(conn) {
            return;
        }
        let got = remote
            .call("unlock at close", |c| async move {
                c.client.lock_release(share, file, owner).await
            })
            .await;
        if let Err(e) = got {
            // The connection's end releases them if the server is gone.
            tracing::warn!("cannot release the locks of a closed file: {}", e.message);
        }
    }

    /// Forgets that `owner` holds locks on node `ino`; once no owner does, the node's
    /// descriptors have nothing to lose. Returns the connection and file it held them
    /// on, if it held any.
    fn forget_owner(&self, ino: u64, owner: u64) -> Option<(u64, LockFile)> {
        let mut nodes = lock(&self.nodes);
        let n = nodes.get_mut(&ino)?;
        if !n.owners.remove(&owner) {
            return None;
        }
        let held = (n.conn, n.file);
        if n.owners.is_empty() {
            nodes.remove(&ino);
            lock(&self.fhs).retain(|_, &mut (_, node)| node != ino);
        }
        Some(held)
    }

    fn granted(&self, ask: LockAsk, conn: u64, file: LockFile) {
        lock(&self.fhs).insert(ask.fh, (conn, ask.ino));
        let mut nodes = lock(&self.nodes);
        let n = nodes.entry(ask.ino).or_insert_with(|| NodeLocks {
            conn,
            file,
            owners: HashSet::new(),
        });
        if n.conn != conn || n.file != file {
            // Taken on an earlier connection (lost with it), or of a file the node's
            // name no longer holds: only the new lock counts.
            n.conn = conn;
            n.file = file;
            n.owners.clear();
        }
        n.owners.insert(ask.owner);
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
        locks.granted(ask, 3, LockFile { dev: 1, ino: 2 });
        assert!(!locks.lost(9, || Some(3)));
        assert!(locks.lost(9, || Some(4)));
        assert!(locks.lost(9, || None));
        assert!(!locks.lost(8, || Some(4)));
        locks.forget_fh(9);
        assert!(!locks.lost(9, || Some(4)));
        // An owner that dropped all it held leaves nothing to lose.
        locks.granted(ask, 3, LockFile { dev: 1, ino: 2 });
        assert!(locks.holds(5, 1));
        assert_eq!(
            locks.forget_owner(5, 1),
            Some((3, LockFile { dev: 1, ino: 2 }))
        );
        assert!(!locks.holds(5, 1));
        assert!(!locks.lost(9, || Some(4)));
        assert_eq!(locks.forget_owner(5, 1), None);
    }
}
