//! `DiskUsage`: counts and sizes of a tree inside a share, walked through directory
//! descriptors ([`crate::fdtree`]) without following any symlink. Blocking.
//!
//! `unique_bytes` is what removing the tree would free. Sound rule: an inode's
//! allocated bytes count only if every one of its links lies in the tree, i.e. the walk
//! met it as many times as its link count. Directories cannot be hard-linked, so each
//! one counts. Inodes with a single link count at once; the others are remembered by
//! `(dev, ino)` until the end of the walk, at most [`MAX_LINKED_INODES`] of them.

use std::collections::HashMap;

use ferry_common::msg::{DiskUsage, Response};
use nix::errno::Errno;
use nix::sys::stat::FileStat;

use crate::fdtree::{is_dir, lstat_at, DescendError, Stack, Top, TreeError, TreeOp};
use crate::share::Share;

/// Most distinct multiply-linked inodes one walk remembers (about 64 MiB of table): a
/// tree with more is refused with [`TreeError::TooManyLinked`] rather than growing the table
/// without bound.
pub const MAX_LINKED_INODES: usize = 1 << 20;

/// Bytes of a 512-byte block, the unit of `st_blocks`.
const BLOCK_BYTES: u64 = 512;

/// A multiply-linked inode met during the walk.
struct Linked {
    /// Names of it the walk met.
    seen: u64,
    /// Its link count when last met.
    nlink: u64,
    /// Its allocated bytes.
    allocated: u64,
}

/// The running totals of a walk.
#[derive(Default)]
struct Tally {
    usage: DiskUsage,
    linked: HashMap<(u64, u64), Linked>,
}

impl Tally {
    // `stat` field types differ between platforms (`nlink_t` is 32 bits on some).
    #[allow(clippy::unnecessary_cast)]
    fn add(&mut self, share: &Share, st: &FileStat) -> Result<(), TreeError> {
        let allocated = (st.st_blocks as u64).saturating_mul(BLOCK_BYTES);
        if is_dir(st) {
            self.usage.dirs += 1;
            self.usage.unique_bytes += allocated;
            return Ok(());
        }
        self.usage.files += 1;
        self.usage.bytes += st.st_size as u64;
        let nlink = st.st_nlink as u64;
        if nlink <= 1 {
            self.usage.unique_bytes += allocated;
            return Ok(());
        }
        let key = (st.st_dev as u64, st.st_ino as u64);
        if !self.linked.contains_key(&key) && self.linked.len() >= MAX_LINKED_INODES {
            return Err(TreeError::TooManyLinked {
                share: share.name().into(),
                limit: MAX_LINKED_INODES,
            });
        }
        let e = self.linked.entry(key).or_insert(Linked {
            seen: 0,
            nlink,
            allocated,
        });
        e.seen += 1;
        e.nlink = nlink;
        Ok(())
    }

    fn finish(mut self) -> DiskUsage {
        self.usage.unique_bytes += self
            .linked
            .values()
            .filter(|l| l.seen >= l.nlink)
            .map(|l| l.allocated)
            .sum::<u64>();
        self.usage
    }
}

/// `DiskUsage` of `rel` (final component not followed; the share root allowed).
/// Allowed on read-only shares; reserved names are refused as for `Remove`. Entries
/// that vanish during the walk are skipped.
pub fn disk_usage(share: &Share, rel: &str) -> Result<Response, TreeError> {
    Ok(Response::DiskUsage(walk(share, rel)?))
}

/// The disk usage of the tree at `rel` (see [`disk_usage`]).
fn walk(share: &Share, rel: &str) -> Result<DiskUsage, TreeError> {
    let mut tally = Tally::default();
    let mut stack = match Top::open(share, rel, false)? {
        Top::Root(root) => {
            let st = nix::sys::stat::fstat(std::os::fd::AsRawFd::as_raw_fd(&root))
                .map_err(|e| io(share, rel, TreeError::Stat, e))?;
            tally.add(share, &st)?;
            let mut stack = Stack::new(None, rel);
            stack.push_root(root);
            stack
        }
        Top::Entry { parent, name } => {
            let st = lstat_at(std::os::fd::AsRawFd::as_raw_fd(&parent), &name)
                .map_err(|e| io(share, rel, TreeError::Stat, e))?;
            tally.add(share, &st)?;
            let mut stack = Stack::new(Some(parent), rel);
            if is_dir(&st) {
                match stack.descend(share, &name) {
                    Ok(()) => {}
                    Err(DescendError::Fatal(e)) => return Err(e),
                    Err(DescendError::Open(e)) => return Err(io(share, rel, TreeError::Open, e)),
                }
            }
            stack
        }
    };
    while let Some(frame) = stack.current() {
        let fd = frame.fd();
        match frame.next_name() {
            Some(Ok((child, _))) => {
                let st = match lstat_at(fd, &child) {
                    Ok(st) => st,
                    Err(Errno::ENOENT) => continue,
                    Err(e) => return Err(stack.error(share, TreeError::Stat, Some(&child), e)),
                };
                tally.add(share, &st)?;
                if is_dir(&st) {
                    match stack.descend(share, &child) {
                        Ok(()) => {}
                        Err(DescendError::Fatal(e)) => return Err(e),
                        // Gone, or no longer a directory, since it was examined.
                        Err(DescendError::Open(Errno::ENOENT | Errno::ELOOP | Errno::ENOTDIR)) => {}
                        Err(DescendError::Open(e)) => {
                            return Err(stack.error(share, TreeError::Open, Some(&child), e))
                        }
                    }
                }
            }
            Some(Err(e)) => return Err(stack.error(share, TreeError::List, None, e)),
            None => {
                stack.ascend();
            }
        }
    }
    Ok(tally.finish())
}

fn io(share: &Share, rel: &str, op: TreeOp, e: Errno) -> TreeError {
    op(share.display(rel), e.into())
}
