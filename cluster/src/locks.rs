//! The locks of a cluster share, held in etcd under this process's own lease (see
//! [`crate::model::locks`] for the keys, the transaction and the invariant).
//!
//! The lease is granted at the first lock and renewed every third of its time to live
//! by a task of its own. Locks live as long as it does: a process that dies or hangs
//! past the time to live loses them, and others may take them.
//!
//! Invariant: a lock the process believes it holds is never one that etcd has already
//! let go. [`ClusterLocks::current`] names the lease only until the time to live has
//! passed since the last renewal was sent (etcd keeps it at least that long), and
//! never again once a renewal failed (the lease is then revoked if etcd still
//! answers); the next lock is taken under a new lease.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::model::locks::{
    conflict, decide, locks_prefix, owner_key, parse_owner_key, OwnerRecord, GEN,
};
use etcd_client::{Compare, CompareOp, GetOptions, PutOptions, Txn, TxnOp};
use ferry_common::locks::{LockError, LockHeld, LockKind, LockOwner};
use ferry_common::msg::{ErrorKind, RemoteError};

use super::meta::Meta;
use ferry_client::error::ClientError;

/// Seconds the locks of a process outlive its last renewal.
pub const LOCK_LEASE_TTL_SECS: i64 = 10;

/// Most transactions one change tries before it gives up (each lost race means another
/// change to the same file's locks committed: progress elsewhere).
const MAX_TRIES: usize = 64;

/// A granted lease and whether its renewals still hold.
struct Lease {
    id: i64,
    /// Cleared when a renewal fails or the lease is ended here.
    alive: AtomicBool,
    /// When the lease may expire at the earliest: the time to live after the last
    /// renewal (or the grant) was sent.
    until: Mutex<Instant>,
}

impl Lease {
    /// Whether the lease surely still holds.
    fn holds(&self) -> bool {
        self.alive.load(Ordering::Acquire)
            && Instant::now() < *self.until.lock().unwrap_or_else(|p| p.into_inner())
    }
}

type Held = Arc<Lease>;

/// The locks one process holds on one cluster share; see the module docs.
pub struct ClusterLocks {
    meta: Meta,
    share: String,
    ttl: i64,
    lease: Mutex<Option<Held>>,
    granting: tokio::sync::Mutex<()>,
}

/// One file's records as read at one revision: `gen`'s mod revision (0: absent) and
/// each owner's record.
type View = (i64, Vec<(LockOwner, OwnerRecord)>);

impl ClusterLocks {
    /// The locks of `share` through `meta`'s etcd, under leases of `ttl` seconds.
    pub fn new(meta: Meta, share: &str, ttl: i64) -> ClusterLocks {
        ClusterLocks {
            meta,
            share: share.to_owned(),
            ttl: ttl.max(1),
            lease: Mutex::new(None),
            granting: tokio::sync::Mutex::new(()),
        }
    }

    /// The live lease's id, if there is one: locks taken under another are gone.
    pub fn current(&self) -> Option<u64> {
        let held = self.lease.lock().unwrap_or_else(|p| p.into_inner()).clone();
        held.filter(|h| h.holds()).map(|h| h.id as u64)
    }

    /// The live lease, granted (and kept alive from now on) if there is none.
    async fn lease(&self) -> Result<i64, ClientError> {
        if let Some(id) = self.current() {
            return Ok(id as i64);
        }
        let _one = self.granting.lock().await;
        if let Some(id) = self.current() {
            return Ok(id as i64);
        }
        let mut etcd = self.meta.etcd();
        let sent = Instant::now();
        let id = etcd
            .lease_grant(self.ttl, None)
            .await
            .map_err(|e| self.meta.err("granting a lease for locks", e))?
            .id();
        let lease = Arc::new(Lease {
            id,
            alive: AtomicBool::new(true),
            until: Mutex::new(sent + self.ttl()),
        });
        tokio::spawn(keep_alive(self.meta.clone(), self.ttl(), lease.clone()));
        *self.lease.lock().unwrap_or_else(|p| p.into_inner()) = Some(lease);
        Ok(id)
    }

    /// The leases' time to live.
    fn ttl(&self) -> Duration {
        Duration::from_secs(self.ttl as u64)
    }

    /// Takes, changes or drops `owner`'s lock of `kind` on `range` of `path` (as
    /// `F_SETLK`: never waits). Returns the lease it is held under and, if another
    /// owner's lock is in the way, that lock (then nothing changed). A lease found
    /// expired on the way (a process that was stopped, or cut from etcd) is replaced
    /// once: the new lock is taken under a new lease.
    pub async fn set(
        &self,
        path: &str,
        owner: u64,
        kind: LockKind,
        range: (u64, u64),
        pid: u32,
    ) -> Result<(u64, Option<LockHeld>), ClientError> {
        let ask = (owner, kind, range, pid);
        match self.set_once(path, ask).await {
            Err(_) if kind != LockKind::Unlock && self.current().is_none() => {
                self.set_once(path, ask).await
            }
            done => done,
        }
    }

    /// [`ClusterLocks::set`] under the live lease, without the second try.
    async fn set_once(
        &self,
        path: &str,
        (owner, kind, range, pid): (u64, LockKind, (u64, u64), u32),
    ) -> Result<(u64, Option<LockHeld>), ClientError> {
        let lease = match (kind, self.current()) {
            // Nothing is held without a live lease: nothing to drop.
            (LockKind::Unlock, None) => return Ok((0, None)),
            _ => self.lease().await?,
        };
        let me = LockOwner {
            session: lease as u64,
            owner,
        };
        let prefix = locks_prefix(&self.share, path);
        for _ in 0..MAX_TRIES {
            let (gen, records) = self.view(&prefix).await?;
            let record = match decide(&records, me, kind, range, pid) {
                Ok(r) => r,
                Err(LockError::Conflict(held)) => return Ok((me.session, Some(held))),
                Err(e) => return Err(refused(e)),
            };
            let others = records.iter().any(|(o, _)| *o != me);
            if self.commit(&prefix, gen, me, &record, others).await? {
                return Ok((me.session, None));
            }
        }
        Err(ClientError::Remote(RemoteError::new(
            ErrorKind::Busy,
            format!("lock {path}: {MAX_TRIES} tries lost to other changes of its locks"),
        )))
    }

    /// The first lock of another owner that stops `owner` taking `kind` on `range`.
    pub async fn test(
        &self,
        path: &str,
        owner: u64,
        kind: LockKind,
        range: (u64, u64),
    ) -> Result<Option<LockHeld>, ClientError> {
        let me = LockOwner {
            session: self.current().unwrap_or(0),
            owner,
        };
        let (_, records) = self.view(&locks_prefix(&self.share, path)).await?;
        Ok(conflict(&records, me, kind, range))
    }

    /// Drops every lock `owner` holds on `path` under `lease` (a close); nothing if
    /// that lease is gone (its locks went with it).
    pub async fn release(&self, path: &str, lease: u64, owner: u64) -> Result<(), ClientError> {
        if self.current() != Some(lease) {
            return Ok(());
        }
        self.set(path, owner, LockKind::Unlock, (0, u64::MAX), 0)
            .await
            .map(|_| ())
    }

    /// Ends the lease (at unmount): every lock of this process goes at once.
    pub async fn close(&self) {
        let held = self.lease.lock().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(h) = held {
            h.alive.store(false, Ordering::Release);
            let _ = self.meta.etcd().lease_revoke(h.id).await;
        }
    }

    /// Every record under `prefix`, at one revision.
    async fn view(&self, prefix: &str) -> Result<View, ClientError> {
        let resp = self
            .meta
            .etcd()
            .get(prefix, Some(GetOptions::new().with_prefix()))
            .await
            .map_err(|e| self.meta.err("reading locks", e))?;
        let mut gen = 0;
        let mut records = Vec::new();
        for kv in resp.kvs() {
            let key = kv.key_str().unwrap_or_default();
            if key.strip_prefix(prefix) == Some(GEN) {
                gen = kv.mod_revision();
            } else if let Some(owner) = parse_owner_key(prefix, key) {
                let record = serde_json::from_slice(kv.value()).map_err(|e| {
                    ClientError::Cluster(format!("etcd: lock record {key} is malformed: {e}"))
                })?;
                records.push((owner, record));
            }
        }
        Ok((gen, records))
    }

    /// Commits `me`'s `record` if `gen` is still at revision `gen`; false if another
    /// change came first. `others`: whether other owners hold records there.
    async fn commit(
        &self,
        prefix: &str,
        gen: i64,
        me: LockOwner,
        record: &OwnerRecord,
        others: bool,
    ) -> Result<bool, ClientError> {
        let gen_key = format!("{prefix}{GEN}");
        let key = owner_key(prefix, me);
        let mut ops = Vec::with_capacity(2);
        if record.ranges.is_empty() {
            ops.push(TxnOp::delete(key, None));
            ops.push(if others {
                TxnOp::put(gen_key.clone(), "", None)
            } else {
                TxnOp::delete(gen_key.clone(), None)
            });
        } else {
            let value = serde_json::to_vec(record).expect("a lock record serialises");
            let lease = PutOptions::new().with_lease(me.session as i64);
            ops.push(TxnOp::put(key, value, Some(lease)));
            ops.push(TxnOp::put(gen_key.clone(), "", None));
        }
        let txn = Txn::new()
            .when(vec![Compare::mod_revision(gen_key, CompareOp::Equal, gen)])
            .and_then(ops);
        let resp = self.meta.etcd().txn(txn).await.map_err(|e| {
            if e.to_string().contains("lease not found") {
                self.lost(me.session);
            }
            self.meta.err("changing a lock", e)
        })?;
        Ok(resp.succeeded())
    }

    /// Lease `id` is gone (etcd says so): its locks are lost.
    fn lost(&self, id: u64) {
        let held = self.lease.lock().unwrap_or_else(|p| p.into_inner()).clone();
        if let Some(h) = held.filter(|h| h.id as u64 == id) {
            h.alive.store(false, Ordering::Release);
        }
    }
}

/// The refusal of a lock request the table rules out other than by a conflict.
fn refused(e: LockError) -> ClientError {
    let kind = match e {
        LockError::TooMany => ErrorKind::Busy,
        LockError::BadRange | LockError::Conflict(_) => ErrorKind::Invalid,
    };
    ClientError::Remote(RemoteError::new(kind, e.to_string()))
}

/// Renews `lease` every third of `ttl` until a renewal fails or the lease is ended
/// here (an unmount); then ends it and revokes it if etcd still answers.
async fn keep_alive(meta: Meta, ttl: Duration, lease: Held) {
    let every = ttl / 3;
    let id = lease.id;
    let renewed = async {
        let (mut keeper, mut stream) = meta.etcd().lease_keep_alive(id).await.ok()?;
        loop {
            tokio::time::sleep(every).await;
            if !lease.alive.load(Ordering::Acquire) {
                return None;
            }
            let sent = Instant::now();
            keeper.keep_alive().await.ok()?;
            match tokio::time::timeout(every, stream.message()).await {
                Ok(Ok(Some(r))) if r.ttl() > 0 => {
                    *lease.until.lock().unwrap_or_else(|p| p.into_inner()) = sent + ttl;
                }
                _ => return None::<()>,
            }
        }
    };
    renewed.await;
    // Cleared here first: the renewals failed (or never started), not an unmount.
    if lease.alive.swap(false, Ordering::AcqRel) {
        tracing::warn!("etcd: the lease of this mount's locks could not be renewed; they are lost");
    }
    let _ = tokio::time::timeout(every, meta.etcd().lease_revoke(id)).await;
}
