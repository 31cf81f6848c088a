//! File locks shared by every session of a server: the wire types of the `locks`
//! capability and [`LockTable`], the pure table ferryd keeps (no I/O, no clock).
//!
//! A lock belongs to a file, named by its server identity [`LockFile`] (`dev`, `ino`:
//! a rename does not escape it), and to a [`LockOwner`]: the session that took it and
//! the owner within that session (the kernel's lock owner, which a mount passes on).
//! Locks follow POSIX record-lock rules (`fcntl(F_SETLK)` as Linux keeps them):
//!
//! - a lock covers bytes `start..=end`; an owner's ranges on one file never overlap:
//!   taking a range replaces what the owner held there (an upgrade, a downgrade or an
//!   unlock splits the owner's older ranges), and touching ranges of one kind merge;
//! - two owners' ranges conflict when they overlap and either is exclusive
//!   ([`LockKind::Write`]); a refused request changes nothing;
//! - an owner never conflicts with itself.
//!
//! `flock` reaches a FUSE file system as a lock of the whole file whose owner is the
//! open file description (fuser does not tell the two apart), so on a mount `flock`
//! and `fcntl` locks exclude each other, as on NFS.
//!
//! Invariant: every range in the table belongs to a session that has not been
//! released ([`LockTable::release_session`]), and `counts` holds the number of ranges
//! of each session (no entry for none), bounded by [`MAX_SESSION_LOCKS`].

use std::collections::HashMap;

use serde::{Deserialize, Serialize};

/// Most ranges one session may hold across all files: a peer cannot grow the table
/// without bound.
pub const MAX_SESSION_LOCKS: usize = 4096;

/// A file's identity on the server: locks follow it across renames.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct LockFile {
    /// Device of the server's filesystem.
    pub dev: u64,
    /// Inode number.
    pub ino: u64,
}

/// What a lock request asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum LockKind {
    /// Shared (`F_RDLCK`, `LOCK_SH`).
    Read,
    /// Exclusive (`F_WRLCK`, `LOCK_EX`).
    Write,
    /// Drop (`F_UNLCK`, `LOCK_UN`).
    Unlock,
}

/// A lock as a conflict reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct LockHeld {
    /// [`LockKind::Read`] or [`LockKind::Write`].
    pub kind: LockKind,
    /// First byte.
    pub start: u64,
    /// Last byte, inclusive.
    pub end: u64,
    /// The process that took it, as its client reported it.
    pub pid: u32,
}

/// Who holds a lock: a session of the server and an owner within it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct LockOwner {
    /// The server's id of the session.
    pub session: u64,
    /// The owner the client named.
    pub owner: u64,
}

/// Why a lock was not taken.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum LockError {
    /// Another owner holds a conflicting lock (it is the one named).
    #[error("another owner holds a conflicting lock on bytes {}..={}", .0.start, .0.end)]
    Conflict(LockHeld),
    /// The session holds [`MAX_SESSION_LOCKS`] ranges already.
    #[error("the session holds too many locks")]
    TooMany,
    /// The range ends before it starts.
    #[error("the lock's range ends before it starts")]
    BadRange,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Range {
    owner: LockOwner,
    held: LockHeld,
}

impl Range {
    fn overlaps(&self, start: u64, end: u64) -> bool {
        self.held.start <= end && start <= self.held.end
    }

    fn conflicts(&self, owner: LockOwner, kind: LockKind, start: u64, end: u64) -> bool {
        self.owner != owner
            && self.overlaps(start, end)
            && (kind == LockKind::Write || self.held.kind == LockKind::Write)
    }
}

/// Every lock of a server; see the module docs.
#[derive(Debug, Default)]
pub struct LockTable {
    files: HashMap<LockFile, Vec<Range>>,
    counts: HashMap<u64, usize>,
}

impl LockTable {
    /// An empty table.
    pub fn new() -> LockTable {
        LockTable::default()
    }

    /// The first lock of another owner that stops `owner` taking `kind` on
    /// `start..=end` of `file` (`None` for [`LockKind::Unlock`]).
    pub fn test(
        &self,
        file: LockFile,
        owner: LockOwner,
        kind: LockKind,
        start: u64,
        end: u64,
    ) -> Option<LockHeld> {
        if kind == LockKind::Unlock {
            return None;
        }
        self.files
            .get(&file)?
            .iter()
            .find(|r| r.conflicts(owner, kind, start, end))
            .map(|r| r.held)
    }

    /// Takes (or, with [`LockKind::Unlock`], drops) `owner`'s lock of `kind` on
    /// `start..=end` of `file`, as `F_SETLK`; on failure nothing changed.
    pub fn set(
        &mut self,
        file: LockFile,
        owner: LockOwner,
        kind: LockKind,
        (start, end): (u64, u64),
        pid: u32,
    ) -> Result<(), LockError> {
        if end < start {
            return Err(LockError::BadRange);
        }
        if let Some(held) = self.test(file, owner, kind, start, end) {
            return Err(LockError::Conflict(held));
        }
        let ranges = self.files.entry(file).or_default();
        let before = ranges.iter().filter(|r| r.owner == owner).count();
        let mut mine: Vec<Range> = Vec::with_capacity(before + 2);
        ranges.retain(|r| {
            if r.owner == owner {
                mine.push(*r);
            }
            r.owner != owner
        });
        let mut kept = cut(&mine, start, end);
        if kind != LockKind::Unlock {
            kept.push(Range {
                owner,
                held: LockHeld {
                    kind,
                    start,
                    end,
                    pid,
                },
            });
        }
        let kept = merge(kept);
        let count = self.counts.get(&owner.session).copied().unwrap_or(0);
        let after = count - before + kept.len();
        if kept.len() > before && after > MAX_SESSION_LOCKS {
            ranges.extend(mine);
            return Err(LockError::TooMany);
        }
        ranges.extend(kept);
        self.settle(file, owner.session, after);
        Ok(())
    }

    /// Drops every lock of `owner` on `file` (a close by that owner).
    pub fn release_owner(&mut self, file: LockFile, owner: LockOwner) {
        let Some(ranges) = self.files.get_mut(&file) else {
            return;
        };
        let before = ranges.len();
        ranges.retain(|r| r.owner != owner);
        let dropped = before - ranges.len();
        let count = self.counts.get(&owner.session).copied().unwrap_or(0);
        self.settle(file, owner.session, count - dropped);
    }

    /// Drops every lock of `session` (it ended); returns how many ranges went.
    pub fn release_session(&mut self, session: u64) -> usize {
        let Some(count) = self.counts.remove(&session) else {
            return 0;
        };
        self.files.retain(|_, ranges| {
            ranges.retain(|r| r.owner.session != session);
            !ranges.is_empty()
        });
        count
    }

    /// The locks held on `file`, in no particular order.
    pub fn held(&self, file: LockFile) -> Vec<(LockOwner, LockHeld)> {
        self.files
            .get(&file)
            .map(|rs| rs.iter().map(|r| (r.owner, r.held)).collect())
            .unwrap_or_default()
    }

    /// Records `session`'s new count and forgets `file` if nothing is locked there.
    fn settle(&mut self, file: LockFile, session: u64, count: usize) {
        if self.files.get(&file).is_some_and(|rs| rs.is_empty()) {
            self.files.remove(&file);
        }
        if count == 0 {
            self.counts.remove(&session);
        } else {
            self.counts.insert(session, count);
        }
    }
}

/// `ranges` (one owner's) with bytes `start..=end` taken out, older ranges split.
fn cut(ranges: &[Range], start: u64, end: u64) -> Vec<Range> {
    let mut out = Vec::with_capacity(ranges.len() + 1);
    for r in ranges {
        if !r.overlaps(start, end) {
            out.push(*r);
            continue;
        }
        if r.held.start < start {
            let mut left = *r;
            left.held.end = start - 1;
            out.push(left);
        }
        if r.held.end > end {
            let mut right = *r;
            right.held.start = end + 1;
            out.push(right);
        }
    }
    out
}

/// One owner's non-overlapping `ranges` with touching ranges of one kind joined.
fn merge(mut ranges: Vec<Range>) -> Vec<Range> {
    ranges.sort_by_key(|r| r.held.start);
    let mut out: Vec<Range> = Vec::with_capacity(ranges.len());
    for r in ranges {
        match out.last_mut() {
            Some(last)
                if last.held.kind == r.held.kind
                    && last.held.end.checked_add(1) == Some(r.held.start) =>
            {
                last.held.end = r.held.end;
                last.held.pid = r.held.pid;
            }
            _ => out.push(r),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    const F: LockFile = LockFile { dev: 1, ino: 2 };
    const G: LockFile = LockFile { dev: 1, ino: 3 };
    const A: LockOwner = LockOwner {
        session: 1,
        owner: 10,
    };
    const A2: LockOwner = LockOwner {
        session: 1,
        owner: 11,
    };
    const B: LockOwner = LockOwner {
        session: 2,
        owner: 10,
    };
    const EOF: u64 = i64::MAX as u64;

    fn spans(t: &LockTable, file: LockFile, owner: LockOwner) -> Vec<(LockKind, u64, u64)> {
        let mut v: Vec<_> = t
            .held(file)
            .into_iter()
            .filter(|(o, _)| *o == owner)
            .map(|(_, h)| (h.kind, h.start, h.end))
            .collect();
        v.sort_by_key(|s| s.1);
        v
    }

    #[test]
    fn exclusive_excludes_other_owners_and_sessions_but_not_its_owner() {
        let mut t = LockTable::new();
        t.set(F, A, LockKind::Write, (0, EOF), 7).unwrap();
        let e = t.set(F, B, LockKind::Write, (0, EOF), 8).unwrap_err();
        assert_eq!(
            e,
            LockError::Conflict(LockHeld {
                kind: LockKind::Write,
                start: 0,
                end: EOF,
                pid: 7
            })
        );
        // Another owner of the same session is another owner.
        assert!(t.set(F, A2, LockKind::Read, (5, 5), 9).is_err());
        // The owner itself may take it again, or downgrade it.
        t.set(F, A, LockKind::Read, (0, EOF), 7).unwrap();
        t.set(F, B, LockKind::Read, (0, 9), 8).unwrap();
        assert!(t.set(F, B, LockKind::Write, (0, 9), 8).is_err());
        // Other files are apart.
        t.set(G, B, LockKind::Write, (0, EOF), 8).unwrap();
    }

    #[test]
    fn disjoint_ranges_are_both_granted_and_overlapping_refused() {
        let mut t = LockTable::new();
        t.set(F, A, LockKind::Write, (0, 99), 1).unwrap();
        t.set(F, B, LockKind::Write, (100, 199), 2).unwrap();
        let got = t.test(F, B, LockKind::Read, 50, 150);
        assert_eq!(
            got.map(|h| (h.kind, h.start, h.end, h.pid)),
            Some((LockKind::Write, 0, 99, 1))
        );
        assert!(t.set(F, B, LockKind::Read, (99, 100), 2).is_err());
        assert_eq!(t.test(F, A, LockKind::Write, 0, 99), None);
        assert_eq!(t.test(F, B, LockKind::Unlock, 0, EOF), None);
    }

    #[test]
    fn unlock_and_downgrade_split_ranges_and_same_kinds_merge() {
        let mut t = LockTable::new();
        t.set(F, A, LockKind::Write, (0, 99), 1).unwrap();
        t.set(F, A, LockKind::Unlock, (40, 59), 1).unwrap();
        assert_eq!(
            spans(&t, F, A),
            vec![(LockKind::Write, 0, 39), (LockKind::Write, 60, 99)]
        );
        t.set(F, A, LockKind::Read, (30, 69), 1).unwrap();
        assert_eq!(
            spans(&t, F, A),
            vec![
                (LockKind::Write, 0, 29),
                (LockKind::Read, 30, 69),
                (LockKind::Write, 70, 99)
            ]
        );
        // The freed middle is shared now: another owner may read-lock it, not write.
        t.set(F, B, LockKind::Read, (40, 50), 2).unwrap();
        assert!(t.set(F, B, LockKind::Write, (40, 50), 2).is_err());
        t.set(F, A, LockKind::Write, (30, 39), 1).unwrap();
        assert_eq!(
            spans(&t, F, A),
            vec![
                (LockKind::Write, 0, 39),
                (LockKind::Read, 40, 69),
                (LockKind::Write, 70, 99)
            ]
        );
        // An upgrade over B's shared range is refused, and changes nothing.
        assert!(t.set(F, A, LockKind::Write, (0, 99), 1).is_err());
        assert_eq!(spans(&t, F, A).len(), 3);
        t.set(F, A, LockKind::Unlock, (0, EOF), 1).unwrap();
        assert!(spans(&t, F, A).is_empty());
        assert_eq!(spans(&t, F, B), vec![(LockKind::Read, 40, 50)]);
    }

    #[test]
    fn touching_ranges_merge_up_to_the_largest_offset() {
        let mut t = LockTable::new();
        t.set(F, A, LockKind::Read, (10, 19), 1).unwrap();
        t.set(F, A, LockKind::Read, (20, u64::MAX), 1).unwrap();
        t.set(F, A, LockKind::Read, (0, 9), 1).unwrap();
        assert_eq!(spans(&t, F, A), vec![(LockKind::Read, 0, u64::MAX)]);
        t.set(F, A, LockKind::Unlock, (u64::MAX, u64::MAX), 1)
            .unwrap();
        assert_eq!(spans(&t, F, A), vec![(LockKind::Read, 0, u64::MAX - 1)]);
        assert_eq!(
            t.set(F, A, LockKind::Read, (5, 4), 1),
            Err(LockError::BadRange)
        );
    }

    #[test]
    fn release_of_an_owner_or_a_session_frees_its_locks_only() {
        let mut t = LockTable::new();
        t.set(F, A, LockKind::Write, (0, 9), 1).unwrap();
        t.set(F, A2, LockKind::Write, (10, 19), 1).unwrap();
        t.set(G, A, LockKind::Write, (0, EOF), 1).unwrap();
        t.set(F, B, LockKind::Read, (20, 29), 2).unwrap();
        t.release_owner(F, A);
        assert!(t.test(F, B, LockKind::Write, 0, 9).is_none());
        assert!(t.test(F, B, LockKind::Write, 10, 19).is_some());
        assert!(t.test(G, B, LockKind::Write, 0, 0).is_some());
        assert_eq!(t.release_session(1), 2);
        assert!(t.test(F, B, LockKind::Write, 0, EOF).is_none());
        assert!(t.test(G, B, LockKind::Write, 0, EOF).is_none());
        assert_eq!(t.release_session(1), 0);
        assert_eq!(t.release_session(2), 1);
        assert!(t.files.is_empty() && t.counts.is_empty());
    }

    #[test]
    fn a_session_holds_a_bounded_number_of_ranges() {
        let mut t = LockTable::new();
        for i in 0..MAX_SESSION_LOCKS as u64 {
            t.set(F, A, LockKind::Write, (2 * i, 2 * i), 1).unwrap();
        }
        let n = MAX_SESSION_LOCKS as u64;
        assert_eq!(
            t.set(F, A, LockKind::Write, (2 * n, 2 * n), 1),
            Err(LockError::TooMany)
        );
        // Changing or dropping what it holds still works.
        t.set(F, A, LockKind::Read, (0, 0), 1).unwrap();
        t.set(F, A, LockKind::Unlock, (0, 0), 1).unwrap();
        t.set(F, A, LockKind::Write, (2 * n, 2 * n), 1).unwrap();
        assert_eq!(t.release_session(1), MAX_SESSION_LOCKS);
    }
}
