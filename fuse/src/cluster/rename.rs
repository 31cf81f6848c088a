//! Renames through a cluster mount.
//!
//! ```text
//!  rename (file, symlink) ──> Meta::rename: delete + put in one etcd transaction,
//!        both names' revisions compared
//!  rename (directory) ──> Meta::read_tree (the subtree and the target, at one
//!        revision) ──> plan_tree_rename (pure: EINVAL into itself, ENOTEMPTY,
//!        EXDEV over the transaction limit) ──> Meta::apply_tree: one transaction
//!        moves every key, values unchanged (no data moves)
//! ```
//!
//! Invariants: the name is at one place or the other, never both or neither (for a
//! directory: the whole subtree); a conflict re-reads and tries again, [`TRIES`]
//! times at most; every path renamed is dropped from the entry cache and its node id
//! moves to the new path (an open descriptor keeps its layout and reads on); a
//! directory with a file below it open for writing here is not renamed (EBUSY), so a
//! staged file is never published under the old name.

use ferry_cluster::meta::{Commit, Versioned};
use ferry_cluster::model::EntryKind;
use ferry_cluster::tree_rename::{
    is_within, plan_tree_rename, TreePlanError, MAX_TREE_ENTRIES, MAX_TXN_OPS,
};
use fuser::{Errno, INodeNo};

use super::write::TRIES;
use super::Inner;
use crate::remote::{lock, OpError};

impl Inner {
    /// rename(2): a file or symlink in one etcd transaction, a directory with its
    /// subtree in one; a replaced file's objects are removed afterwards.
    pub(super) async fn rename(
        &self,
        parent: INodeNo,
        name: &std::ffi::OsStr,
        newparent: INodeNo,
        newname: &std::ffi::OsStr,
        flags: u32,
    ) -> Result<(), OpError> {
        self.writer()?;
        if flags & nix::libc::RENAME_EXCHANGE != 0 {
            return Err(OpError::new(
                Errno::EINVAL,
                "RENAME_EXCHANGE is not supported",
            ));
        }
        let noreplace = flags & nix::libc::RENAME_NOREPLACE != 0;
        let (from, from_sp) = self.child(parent, name)?;
        let (to, to_sp) = self.child(newparent, newname)?;
        let meta = self.nodes.meta();
        for _ in 0..TRIES {
            let Some(src) = self
                .etcd(&from_sp, meta.entry(&self.share, &from_sp))
                .await?
            else {
                if self.staged_at(&from).is_some() {
                    // Created here and not published yet: it moves where it will be.
                    return self.rename_unpublished(&from, &to, noreplace).await;
                }
                self.forget(&from);
                return Err(OpError::new(Errno::ENOENT, from_sp));
            };
            if from_sp == to_sp {
                return Ok(());
            }
            let done = if src.entry.kind == EntryKind::Dir {
                self.rename_dir(&from, &to, noreplace).await?
            } else {
                self.rename_one(&from, src, &to, noreplace).await?
            };
            if done {
                return Ok(());
            }
        }
        Err(OpError::new(
            Errno::EIO,
            format!("{from_sp} -> {to_sp}: changed by others {TRIES} times in a row"),
        ))
    }

    /// Moves file or symlink `src` at mount path `from` to `to`: false if either
    /// name changed since it was read (try again).
    async fn rename_one(
        &self,
        from: &str,
        src: Versioned,
        to: &str,
        noreplace: bool,
    ) -> Result<bool, OpError> {
        let w = self.writer()?;
        let (from_sp, to_sp) = (self.share_path(from), self.share_path(to));
        let meta = self.nodes.meta();
        let dst = self.etcd(&to_sp, meta.entry(&self.share, &to_sp)).await?;
        if let Some(d) = &dst {
            if noreplace {
                return Err(OpError::new(Errno::EEXIST, to_sp));
            }
            if d.entry.kind == EntryKind::Dir {
                return Err(OpError::new(Errno::EISDIR, to_sp));
            }
        }
        let to_rev = dst.as_ref().map_or(0, |d| d.revision);
        let renamed = meta.rename(
            &self.share,
            &from_sp,
            src.revision,
            &to_sp,
            to_rev,
            &src.entry,
        );
        if self.etcd(&to_sp, renamed).await? == Commit::Conflict {
            return Ok(false);
        }
        lock(&self.names).rename(from, to, src.entry.kind);
        self.follow_rename(from, to);
        let kept = src.entry.layout.as_ref().map(|l| l.id.as_str());
        if let Some(old) = dst
            .and_then(|d| d.entry.layout)
            .filter(|l| Some(l.id.as_str()) != kept)
        {
            w.cluster.remove_unshared(&self.share, &old).await;
        }
        Ok(true)
    }

    /// Moves directory `from` (mount path) with everything below it to `to`, in one
    /// etcd transaction: false if anything in it changed since it was read (try
    /// again).
    async fn rename_dir(&self, from: &str, to: &str, noreplace: bool) -> Result<bool, OpError> {
        let (from_sp, to_sp) = (self.share_path(from), self.share_path(to));
        if is_within(&to_sp, &from_sp) {
            return Err(OpError::new(
                Errno::EINVAL,
                format!("{from_sp} -> {to_sp}: a directory cannot be moved into itself"),
            ));
        }
        self.refuse_staged_below(from)?;
        let meta = self.nodes.meta();
        let read = self
            .etcd(&from_sp, meta.read_tree(&self.share, &from_sp, &to_sp))
            .await?;
        let plan = match plan_tree_rename(&self.share, &from_sp, &to_sp, &read, noreplace) {
            Ok(plan) => plan,
            Err(TreePlanError::SourceNotDir) => return Ok(false),
            Err(e) => return Err(tree_error(e, &from_sp, &to_sp)),
        };
        if self.etcd(&from_sp, meta.apply_tree(&plan)).await? == Commit::Conflict {
            return Ok(false);
        }
        lock(&self.names).rename_tree(from, to);
        Ok(true)
    }

    /// Renames file `from`, created through this mount and not published yet: its
    /// handles publish at `to` (whose entry, if any, their publication replaces).
    async fn rename_unpublished(
        &self,
        from: &str,
        to: &str,
        noreplace: bool,
    ) -> Result<(), OpError> {
        let to_sp = self.share_path(to);
        let meta = self.nodes.meta();
        let dst = self.etcd(&to_sp, meta.entry(&self.share, &to_sp)).await?;
        match dst {
            Some(_) if noreplace => return Err(OpError::new(Errno::EEXIST, to_sp)),
            Some(d) if d.entry.kind == EntryKind::Dir => {
                return Err(OpError::new(Errno::EISDIR, to_sp))
            }
            _ => {}
        }
        lock(&self.names).rename(from, to, EntryKind::File);
        self.follow_rename(from, to);
        self.forget(from);
        self.forget(to);
        Ok(())
    }

    /// File `from` (mount path) is now `to`: its handles open for writing here publish
    /// there from now on, and the newest of them holds `to`'s attributes.
    fn follow_rename(&self, from: &str, to: &str) {
        for s in lock(&self.writes).values() {
            if s.path() == from {
                s.move_to(to);
            }
        }
        let mut staged = lock(&self.staged);
        if let Some(s) = staged.remove(from) {
            staged.insert(to.to_owned(), s);
        }
    }

    /// EBUSY if a file at or below directory `dir` (mount path) is open for writing
    /// through this mount: its staged version would be published under the old name.
    fn refuse_staged_below(&self, dir: &str) -> Result<(), OpError> {
        let open = lock(&self.writes)
            .values()
            .map(|s| s.path())
            .find(|p| is_within(p, dir));
        match open {
            Some(path) => Err(OpError::new(
                Errno::EBUSY,
                format!(
                    "{}: open for writing here; a directory above it is not renamed \
                     until it is closed",
                    self.share_path(&path)
                ),
            )),
            None => Ok(()),
        }
    }
}

/// The errno and message of a directory rename that was not planned.
fn tree_error(e: TreePlanError, from: &str, to: &str) -> OpError {
    let errno = match e {
        TreePlanError::IntoItself => Errno::EINVAL,
        TreePlanError::SourceMissing => Errno::ENOENT,
        TreePlanError::SourceNotDir => Errno::EIO,
        TreePlanError::TargetExists => Errno::EEXIST,
        TreePlanError::TargetNotDir => Errno::ENOTDIR,
        TreePlanError::TargetNotEmpty => Errno::ENOTEMPTY,
        // EXDEV: `mv` falls back to copying and removing.
        TreePlanError::TooMany { .. } | TreePlanError::TooBig { .. } => {
            return OpError::new(
                Errno::EXDEV,
                format!(
                    "{from} -> {to}: {e}; a directory of at most {MAX_TREE_ENTRIES} entries \
                     renames in one transaction (etcd --max-txn-ops {MAX_TXN_OPS}): EXDEV, \
                     so mv copies instead"
                ),
            )
        }
    };
    OpError::new(errno, format!("{from} -> {to}: {e}"))
}
