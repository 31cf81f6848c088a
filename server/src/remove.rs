//! `Remove`: deleting a file, symlink or directory tree inside a writable share.
//!
//! Invariant: nothing outside the tree named by the request is removed, and nothing
//! outside the share is looked at. The tree's parent is opened by descriptor from the
//! share root and the tree is walked through directory descriptors ([`crate::fdtree`]):
//! a symlink met anywhere is unlinked as a link, never followed, whatever it points
//! at. Blocking: run it on the blocking pool (a tree of 100k entries takes a while).

use std::ffi::CStr;
use std::os::fd::AsRawFd;

use ferry_common::msg::Response;
use nix::dir::Type;
use nix::errno::Errno;
use nix::unistd::{unlinkat, UnlinkatFlags};

use crate::fdtree::{is_dir, lstat_at, DescendError, Stack, Top, TreeError};
use crate::share::Share;

/// Times one directory is emptied before its removal gives up: a directory that is
/// still not empty after that many passes is being filled concurrently.
const MAX_PASSES: u32 = 4;

/// `Remove`: removes `rel` (final component not followed). A directory must be empty
/// unless `recursive`. The share root, reserved names and read-only shares are refused
/// (see [`Top::open`]).
pub fn remove(share: &Share, rel: &str, recursive: bool) -> Result<Response, TreeError> {
    let (parent, name) = match Top::open(share, rel, true)? {
        Top::Entry { parent, name } => (parent, name),
        // `write` refuses the root; kept as a refusal should that ever change.
        Top::Root(_) => {
            return Err(TreeError::RemoveRoot {
                path: share.display(rel),
            })
        }
    };
    let what = share.display(rel);
    let st =
        lstat_at(parent.as_raw_fd(), &name).map_err(|e| TreeError::Stat(what.clone(), e.into()))?;
    if !is_dir(&st) {
        return unlinkat(
            Some(parent.as_raw_fd()),
            name.as_c_str(),
            UnlinkatFlags::NoRemoveDir,
        )
        .map(|()| Response::Ok)
        .map_err(|e| TreeError::Remove(what, e.into()));
    }
    if !recursive {
        return match unlinkat(
            Some(parent.as_raw_fd()),
            name.as_c_str(),
            UnlinkatFlags::RemoveDir,
        ) {
            Ok(()) => Ok(Response::Ok),
            Err(Errno::ENOTEMPTY | Errno::EEXIST) => Err(TreeError::NotEmpty { path: what }),
            Err(e) => Err(TreeError::Remove(what, e.into())),
        };
    }
    remove_tree(share, Stack::new(Some(parent), rel), &name)?;
    Ok(Response::Ok)
}

/// Removes the directory `name` of the stack's base and everything below it,
/// depth first with an explicit stack (one open directory per level).
fn remove_tree(share: &Share, mut stack: Stack, name: &CStr) -> Result<(), TreeError> {
    enter(share, &mut stack, name, true)?;
    // Passes made over each directory on the stack, in stack order.
    let mut passes: Vec<u32> = vec![1];
    loop {
        let Some(frame) = stack.current() else {
            return Ok(());
        };
        let fd = frame.fd();
        match frame.next_name() {
            Some(Ok((child, kind))) => {
                let dir = match kind {
                    Some(Type::Directory) => true,
                    Some(_) => false,
                    None => match lstat_at(fd, &child) {
                        Ok(st) => is_dir(&st),
                        Err(Errno::ENOENT) => continue,
                        Err(e) => return Err(stack.error(share, TreeError::Stat, Some(&child), e)),
                    },
                };
                if !dir {
                    match unlinkat(Some(fd), child.as_c_str(), UnlinkatFlags::NoRemoveDir) {
                        Ok(()) | Err(Errno::ENOENT) => continue,
                        // It became a directory since `readdir`: entered below.
                        Err(Errno::EISDIR) => {}
                        Err(e) => {
                            return Err(stack.error(share, TreeError::Remove, Some(&child), e))
                        }
                    }
                }
                if enter(share, &mut stack, &child, false)? {
                    passes.push(1);
                }
            }
            Some(Err(e)) => return Err(stack.error(share, TreeError::List, None, e)),
            None => {
                let what = stack.display(share, None);
                let done = stack.ascend().unwrap_or_default();
                let pass = passes.pop().unwrap_or(MAX_PASSES);
                let Some(parent) = stack.fd() else {
                    return Err(TreeError::LostParent { path: what });
                };
                match unlinkat(Some(parent), done.as_c_str(), UnlinkatFlags::RemoveDir) {
                    Ok(()) | Err(Errno::ENOENT) => {}
                    // Something was added while the directory was being emptied.
                    Err(Errno::ENOTEMPTY | Errno::EEXIST) if pass < MAX_PASSES => {
                        if enter(share, &mut stack, &done, false)? {
                            passes.push(pass + 1);
                        }
                    }
                    Err(Errno::ENOTEMPTY | Errno::EEXIST) => {
                        return Err(TreeError::KeepsFilling {
                            path: what,
                            passes: MAX_PASSES,
                        })
                    }
                    Err(e) => return Err(TreeError::Remove(what, e.into())),
                }
            }
        }
    }
}

/// Descends into the directory `name` of the current one. Returns false (and removes
/// nothing) if it is gone; an entry that stopped being a directory since it was
/// examined (a symlink swapped in, say) is unlinked as what it is now, never entered.
/// `must_exist` for the tree's top: its absence is an error.
fn enter(
    share: &Share,
    stack: &mut Stack,
    name: &CStr,
    must_exist: bool,
) -> Result<bool, TreeError> {
    match stack.descend(share, name) {
        Ok(()) => Ok(true),
        Err(DescendError::Fatal(e)) => Err(e),
        Err(DescendError::Open(Errno::ENOENT)) if !must_exist => Ok(false),
        Err(DescendError::Open(Errno::ELOOP | Errno::ENOTDIR)) => {
            let Some(fd) = stack.fd() else {
                return Err(stack.error(share, TreeError::Remove, Some(name), Errno::EBADF));
            };
            match unlinkat(Some(fd), name, UnlinkatFlags::NoRemoveDir) {
                Ok(()) | Err(Errno::ENOENT) => Ok(false),
                Err(e) => Err(stack.error(share, TreeError::Remove, Some(name), e)),
            }
        }
        Err(DescendError::Open(e)) => Err(stack.error(share, TreeError::Open, Some(name), e)),
    }
}
