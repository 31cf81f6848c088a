//! Locks through a cluster mount: `fcntl` record locks and `flock`, held in the
//! cluster's etcd under this mount's lease ([`ClusterLocks`]), so they exclude holders
//! on every other mount of the share; [`crate::locks::Locks`] keeps what this mount
//! holds, as on a single server's share, with the lease in place of the connection.
//!
//! - A mount that dies, or hangs past the lease's time to live
//!   ([`LOCK_LEASE_TTL_SECS`]), loses its locks; a descriptor that held some then fails
//!   its reads, writes and locks with `EIO` until it is closed.
//! - Locks are named by the file's share path: a rename does not carry them.
//! - Data stays close-to-open (files are published whole): an unlock publishes what
//!   the descriptor wrote first, so the next holder that opens the file reads it; a
//!   descriptor kept open across another mount's change keeps reading the version it
//!   opened.

use std::sync::Arc;

use ferry_cluster::locks::ClusterLocks;
use ferry_cluster::model::locks::lock_file;
use ferry_common::locks::{LockFile, LockHeld, LockKind};
use fuser::Errno;

use super::Inner;
use crate::locks::{LockAnswer, LockAsk, LockBackend};
use crate::remote::{lock, OpError};

pub use ferry_cluster::locks::LOCK_LEASE_TTL_SECS;

impl LockBackend for Inner {
    fn current(&self) -> Option<u64> {
        self.held.current()
    }

    async fn set(&self, sp: &str, ask: LockAsk) -> Result<LockAnswer, OpError> {
        let range = (ask.start, ask.end);
        let (conn, conflict) = self
            .etcd(sp, self.held.set(sp, ask.owner, ask.kind, range, ask.pid))
            .await?;
        Ok(LockAnswer {
            conn,
            file: lock_file(&self.share, sp),
            conflict,
        })
    }

    async fn test(&self, sp: &str, ask: LockAsk) -> Result<Option<LockHeld>, OpError> {
        let range = (ask.start, ask.end);
        self.etcd(sp, self.held.test(sp, ask.owner, ask.kind, range))
            .await
    }

    async fn release(
        &self,
        conn: u64,
        _file: LockFile,
        sp: &str,
        owner: u64,
    ) -> Result<(), OpError> {
        self.etcd(sp, self.held.release(sp, conn, owner)).await
    }
}

impl Inner {
    /// Whether descriptor `fh` lost its locks with an earlier lease.
    pub(super) fn lock_lost(&self, fh: u64) -> Result<(), OpError> {
        if self.locks.lost(fh, || self.held.current()) {
            return Err(OpError::new(
                Errno::EIO,
                "its locks were lost with the mount's etcd lease",
            ));
        }
        Ok(())
    }

    /// `F_SETLK` (`waiter`: `F_SETLKW` by that thread). Before an unlock, what the
    /// descriptor wrote is published.
    pub(super) async fn set_lock(&self, ask: LockAsk, waiter: Option<u32>) -> Result<(), OpError> {
        self.lock_lost(ask.fh)?;
        let sp = self.lock_path(ask.ino)?;
        if ask.kind == LockKind::Unlock {
            let staged = lock(&self.writes).get(&ask.fh).cloned();
            if let Some(staged) = staged {
                self.publish(&staged).await?;
            }
        }
        self.locks.set(self, &sp, ask, waiter).await
    }

    /// `F_GETLK`: the lock in the way of `ask`, if any.
    pub(super) async fn test_lock(&self, ask: LockAsk) -> Result<Option<LockHeld>, OpError> {
        self.lock_lost(ask.fh)?;
        let sp = self.lock_path(ask.ino)?;
        self.locks.test(self, &sp, ask).await
    }

    /// Drops `owner`'s locks on node `ino` (a close), if it holds any.
    pub(super) async fn release_locks(&self, ino: u64, owner: u64) {
        self.locks.release(self, ino, owner).await
    }

    /// The share path of node `ino`.
    fn lock_path(&self, ino: u64) -> Result<String, OpError> {
        let (path, _) = self.path_of(fuser::INodeNo(ino))?;
        Ok(self.share_path(&path))
    }
}

/// The locks of `share` through `meta`'s etcd, under this mount's lease.
pub fn cluster_locks(meta: ferry_cluster::meta::Meta, share: &str) -> Arc<ClusterLocks> {
    Arc::new(ClusterLocks::new(meta, share, LOCK_LEASE_TTL_SECS))
}
