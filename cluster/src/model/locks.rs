//! File locks of a cluster share, as they are kept in etcd: the keys, and the pure
//! decision of what one lock request changes (no I/O; the etcd side is the client's).
//!
//! A cluster share has no server that could hold its locks, so every mount keeps its
//! own in etcd, under a lease of its own that it keeps alive: a mount that dies, or
//! hangs past the lease's time to live, loses its locks with the lease. Per locked file
//! (named by its share path: a rename does not carry its locks, unlike a single
//! server's, which follow the inode):
//!
//! ```text
//!  /ferry/locks/SHARE/HEX(PATH)/gen                 bumped by every change (no lease)
//!  /ferry/locks/SHARE/HEX(PATH)/o/LEASE.OWNER       one owner's ranges (its mount's lease)
//! ```
//!
//! A change reads the whole prefix at one revision, decides here ([`decide`]) with the
//! rules of [`ferry_common::locks::LockTable`], and commits in a transaction that compares
//! `gen`'s mod revision with the one read (0: absent) and puts `gen` again, so two
//! changes to one file's locks never both commit on one view. The owner key of the
//! decision is put under the mount's lease, or deleted when it holds nothing; the last
//! owner to leave deletes `gen` too.
//!
//! Invariant: the owner records under one prefix never conflict with each other (each
//! was committed on a view that held every other record then alive; a record that a
//! lease's expiry removed behind a view only made that view stricter).

use serde::{Deserialize, Serialize};

use super::ROOT_PREFIX;
use ferry_common::locks::{LockError, LockFile, LockHeld, LockKind, LockOwner, LockTable};

/// The key that every change to a file's locks bumps.
pub const GEN: &str = "gen";

/// The prefix of every lock key of every share.
pub fn all_locks_prefix() -> String {
    format!("{ROOT_PREFIX}locks/")
}

/// The prefix of the lock keys of `path` (share-relative) in `share`. The path is
/// written in hex, so no file's prefix is a prefix of another's.
pub fn locks_prefix(share: &str, path: &str) -> String {
    let hex: String = path.bytes().map(|b| format!("{b:02x}")).collect();
    format!("{ROOT_PREFIX}locks/{share}/{hex}/")
}

/// The key of `owner`'s record under `prefix` (a [`locks_prefix`]).
pub fn owner_key(prefix: &str, owner: LockOwner) -> String {
    format!("{prefix}o/{:016x}.{:016x}", owner.session, owner.owner)
}

/// The owner a key under `prefix` names; `None` for `gen` and anything else.
pub fn parse_owner_key(prefix: &str, key: &str) -> Option<LockOwner> {
    let (session, owner) = key
        .strip_prefix(prefix)?
        .strip_prefix("o/")?
        .split_once('.')?;
    Some(LockOwner {
        session: u64::from_str_radix(session, 16).ok()?,
        owner: u64::from_str_radix(owner, 16).ok()?,
    })
}

/// One owner's ranges on one file, as its key's value holds them.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct OwnerRecord {
    /// Non-overlapping ranges, none of them [`LockKind::Unlock`].
    pub ranges: Vec<LockHeld>,
}

/// The identity a cluster lock reports for `path`: stable for the path, so a mount can
/// tell two files apart (FNV-1a of the share and path; `dev` 0).
pub fn lock_file(share: &str, path: &str) -> LockFile {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in share.bytes().chain([0]).chain(path.bytes()) {
        h = (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
    }
    LockFile { dev: 0, ino: h }
}

/// The table of one file's records (as read under one prefix).
fn table_of(file: LockFile, records: &[(LockOwner, OwnerRecord)]) -> LockTable {
    let mut table = LockTable::new();
    for (owner, record) in records {
        for r in &record.ranges {
            if r.kind == LockKind::Unlock {
                continue;
            }
            // Records never conflict (the module's invariant); a range that would is
            // left out rather than trusted over the others.
            let _ = table.set(file, *owner, r.kind, (r.start, r.end), r.pid);
        }
    }
    table
}

/// What `me` taking `kind` on `range` (with `pid`) leaves as its record, given every
/// record of the file: its new ranges (empty: delete the record), or the lock in the
/// way (then nothing may change).
pub fn decide(
    records: &[(LockOwner, OwnerRecord)],
    me: LockOwner,
    kind: LockKind,
    range: (u64, u64),
    pid: u32,
) -> Result<OwnerRecord, LockError> {
    let file = LockFile { dev: 0, ino: 0 };
    let mut table = table_of(file, records);
    table.set(file, me, kind, range, pid)?;
    let ranges = table
        .held(file)
        .into_iter()
        .filter(|(o, _)| *o == me)
        .map(|(_, h)| h)
        .collect();
    Ok(OwnerRecord { ranges })
}

/// The first lock of another owner that stops `me` taking `kind` on `range`.
pub fn conflict(
    records: &[(LockOwner, OwnerRecord)],
    me: LockOwner,
    kind: LockKind,
    (start, end): (u64, u64),
) -> Option<LockHeld> {
    let file = LockFile { dev: 0, ino: 0 };
    table_of(file, records).test(file, me, kind, start, end)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn owner(session: u64, owner: u64) -> LockOwner {
        LockOwner { session, owner }
    }

    fn held(kind: LockKind, start: u64, end: u64) -> LockHeld {
        LockHeld {
            kind,
            start,
            end,
            pid: 7,
        }
    }

    #[test]
    fn keys_name_their_owner_and_no_prefix_holds_another_file() {
        let p = locks_prefix("s", "a");
        let q = locks_prefix("s", "a/b");
        assert!(!q.starts_with(&p) && !p.starts_with(&q));
        let o = owner(0x1234, u64::MAX);
        assert_eq!(parse_owner_key(&p, &owner_key(&p, o)), Some(o));
        assert_eq!(parse_owner_key(&p, &format!("{p}{GEN}")), None);
        assert_eq!(parse_owner_key(&q, &owner_key(&p, o)), None);
        assert_ne!(lock_file("s", "a"), lock_file("s", "b"));
        assert_ne!(lock_file("s", "ab"), lock_file("sa", "b"));
    }

    #[test]
    fn a_decision_follows_the_table_rules_and_leaves_others_alone() {
        let a = owner(1, 1);
        let b = owner(2, 1);
        let records = vec![(
            a,
            OwnerRecord {
                ranges: vec![held(LockKind::Read, 0, 9)],
            },
        )];
        // A shared lock beside another: granted, only b's own ranges come back.
        let got = decide(&records, b, LockKind::Read, (5, 20), 7).unwrap();
        assert_eq!(got.ranges, vec![held(LockKind::Read, 5, 20)]);
        // An exclusive one over a's range: refused, naming a's lock.
        assert_eq!(
            decide(&records, b, LockKind::Write, (9, 9), 7),
            Err(LockError::Conflict(held(LockKind::Read, 0, 9)))
        );
        assert_eq!(
            conflict(&records, b, LockKind::Write, (0, 0)),
            Some(held(LockKind::Read, 0, 9))
        );
        // An owner never conflicts with itself; upgrading splits nothing else.
        let got = decide(&records, a, LockKind::Write, (0, 4), 7).unwrap();
        assert_eq!(got.ranges.len(), 2);
        // Unlocking everything leaves an empty record (deleted).
        let got = decide(&records, a, LockKind::Unlock, (0, u64::MAX), 7).unwrap();
        assert!(got.ranges.is_empty());
    }
}
