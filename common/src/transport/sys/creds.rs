//! Acting as another user on one thread: the file-system uid and gid (`setfsuid`,
//! `setfsgid`) and the supplementary groups of the calling thread only, so that the
//! kernel checks permissions and picks owners for that user while other threads of
//! the process go on as they are.
//!
//! Invariant: credentials are per thread in Linux, and only the raw `setgroups` system
//! call keeps them so; glibc's `setgroups()` changes every thread of the process (it
//! broadcasts the change), so it is never used here. A [`Guard`] restores the thread's
//! file-system ids and groups when dropped, so a pooled thread never runs a later task
//! as the user of an earlier one. A thread that acts as someone is marked, for
//! [`acting`]. Such a thread first unshares its file-system attributes (`CLONE_FS`)
//! so that, while acting, its umask is 0 (the caller's modes come with the caller's
//! umask applied) without changing the process's.

use std::cell::Cell;
use std::io;

use nix::libc;
use nix::sched::{unshare, CloneFlags};
use nix::sys::stat::{umask, Mode};
use nix::unistd::{setfsgid, setfsuid, Gid, Uid};

/// Most supplementary groups a caller may carry (the kernel's `NGROUPS_MAX`).
pub const MAX_GROUPS: usize = crate::msg::CALLER_MAX_GROUPS;

thread_local! {
    static ACTING: Cell<bool> = const { Cell::new(false) };
    /// This thread has its own umask (and working directory), unshared from the
    /// process's, so it can make entries with exactly the caller's modes.
    static OWN_FS: Cell<bool> = const { Cell::new(false) };
}

/// Whether this thread is acting as a caller (a [`Guard`] is alive on it).
pub fn acting() -> bool {
    ACTING.with(Cell::get)
}

/// The calling thread acting as a caller until dropped.
#[must_use = "the thread acts as the caller only while the guard lives"]
#[derive(Debug)]
pub struct Guard {
    uid: Uid,
    gid: Gid,
    groups: Vec<libc::gid_t>,
    umask: Mode,
}

/// Makes the calling thread act as `uid`/`gid` with supplementary `groups` for file
/// system access (its real and effective ids are unchanged) until the guard is
/// dropped. The process must be privileged (`CAP_SETUID`, `CAP_SETGID`). Fails, with
/// the thread as it was, where the kernel refuses.
pub fn act_as(uid: u32, gid: u32, groups: &[u32]) -> io::Result<Guard> {
    if groups.len() > MAX_GROUPS {
        return Err(io::Error::from_raw_os_error(libc::EINVAL));
    }
    if !OWN_FS.with(Cell::get) {
        unshare(CloneFlags::CLONE_FS).map_err(io::Error::from)?;
        OWN_FS.with(|o| o.set(true));
    }
    let saved = thread_groups()?;
    set_thread_groups(groups)?;
    let guard = Guard {
        uid: setfsuid(Uid::from_raw(uid)),
        gid: setfsgid(Gid::from_raw(gid)),
        groups: saved,
        // The caller's modes arrive with its own umask applied: none is added here.
        umask: umask(Mode::empty()),
    };
    ACTING.with(|a| a.set(true));
    // setfsuid answers the previous id whether or not it changed it: asking again
    // (with an invalid id, which changes nothing) tells what holds now.
    let now_uid = setfsuid(Uid::from_raw(u32::MAX));
    let now_gid = setfsgid(Gid::from_raw(u32::MAX));
    if now_uid.as_raw() != uid || now_gid.as_raw() != gid {
        drop(guard);
        return Err(io::Error::from_raw_os_error(libc::EPERM));
    }
    Ok(guard)
}

impl Drop for Guard {
    fn drop(&mut self) {
        setfsuid(self.uid);
        setfsgid(self.gid);
        umask(self.umask);
        if let Err(e) = set_thread_groups(&self.groups) {
            // A thread that cannot get its groups back must not serve anyone else.
            panic!("cannot restore this thread's supplementary groups: {e}");
        }
        ACTING.with(|a| a.set(false));
    }
}

/// The calling thread's supplementary groups.
fn thread_groups() -> io::Result<Vec<libc::gid_t>> {
    // SAFETY: with a size of 0, getgroups writes nothing and returns the count.
    let n = unsafe { libc::getgroups(0, std::ptr::null_mut()) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    let mut groups = vec![0 as libc::gid_t; n as usize];
    // SAFETY: `groups` has room for `n` entries, the size passed.
    let got = unsafe { libc::getgroups(n, groups.as_mut_ptr()) };
    if got < 0 {
        return Err(io::Error::last_os_error());
    }
    groups.truncate(got as usize);
    Ok(groups)
}

/// Sets the calling thread's supplementary groups with the raw system call (this
/// thread only; see the module docs).
fn set_thread_groups(groups: &[libc::gid_t]) -> io::Result<()> {
    // SAFETY: the kernel reads `groups.len()` ids from the pointer, which points at
    // that many initialised `gid_t`s (or is dangling with a length of 0, never read).
    let r = unsafe {
        libc::syscall(
            libc::SYS_setgroups,
            groups.len() as libc::size_t,
            groups.as_ptr(),
        )
    };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn acts_on_one_thread_and_restores() {
        if !nix::unistd::geteuid().is_root() {
            return;
        }
        let before = thread_groups().unwrap();
        let (acted, done) = (std::sync::Barrier::new(2), std::sync::Barrier::new(2));
        std::thread::scope(|s| {
            s.spawn(|| {
                acted.wait();
                // Another thread of the process keeps its own groups meanwhile.
                assert_eq!(thread_groups().unwrap(), before);
                done.wait();
            });
            s.spawn(|| {
                let g = act_as(65534, 65534, &[65533]).unwrap();
                assert!(acting());
                assert_eq!(thread_groups().unwrap(), vec![65533]);
                acted.wait();
                done.wait();
                drop(g);
                assert!(!acting());
                assert_eq!(thread_groups().unwrap(), before);
                assert_eq!(setfsuid(Uid::from_raw(u32::MAX)).as_raw(), 0);
            });
        });
    }
}
