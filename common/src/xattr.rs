//! Extended attributes of an entry itself: the `l*xattr(2)` calls, which never follow
//! a final symlink, and which names the protocol's `xattr` capability carries.
//!
//! Carried: `user.*` always, `trusted.*` and `security.*` where the side that applies
//! them may (the kernel refuses them to an unprivileged process with `EPERM`, and an
//! unprivileged `llistxattr` leaves `trusted.*` out). Refused: `system.*` (POSIX ACLs,
//! whose numeric ids mean nothing on another machine) and any other namespace, with
//! [`NameError::Namespace`], reported as "not supported". Blocking.

use std::io;
use std::path::Path;

use rustix::fs::XattrFlags;

use crate::msg::{XattrSetMode, XATTR_LIST_MAX, XATTR_NAME_MAX, XATTR_SIZE_MAX};

/// The namespace prefixes carried (see the module's doc).
pub const CARRIED: &[&[u8]] = &[b"user.", b"trusted.", b"security."];

/// Why a name is not one the protocol carries.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NameError {
    /// Longer than [`XATTR_NAME_MAX`].
    #[error("extended attribute name of {0} bytes is over the limit of {XATTR_NAME_MAX}")]
    TooLong(usize),
    /// Empty after its prefix, or holding a NUL byte.
    #[error("invalid extended attribute name")]
    Invalid,
    /// Outside the carried namespaces.
    #[error(
        "extended attributes outside user.*, trusted.* and security.* (system.* ACLs \
         among them) are not supported"
    )]
    Namespace,
}

/// Fails unless `name` is a carried name (see the module's doc) within the limits.
pub fn check_name(name: &[u8]) -> Result<(), NameError> {
    if name.len() > XATTR_NAME_MAX {
        return Err(NameError::TooLong(name.len()));
    }
    if name.contains(&0) {
        return Err(NameError::Invalid);
    }
    match CARRIED.iter().find(|p| name.starts_with(p)) {
        Some(p) if name.len() > p.len() => Ok(()),
        Some(_) => Err(NameError::Invalid),
        None => Err(NameError::Namespace),
    }
}

/// The names of `path`'s extended attributes (its own, a symlink not followed) that
/// [`check_name`] accepts, in the file system's order.
pub fn list(path: &Path) -> io::Result<Vec<Vec<u8>>> {
    let mut buf = vec![0u8; XATTR_LIST_MAX];
    let len = rustix::fs::llistxattr(path, &mut buf[..])?;
    Ok(buf[..len]
        .split(|&b| b == 0)
        .filter(|n| check_name(n).is_ok())
        .map(<[u8]>::to_vec)
        .collect())
}

/// The value of `path`'s extended attribute `name` (`ENODATA` if it has none).
pub fn get(path: &Path, name: &[u8]) -> io::Result<Vec<u8>> {
    let mut buf = vec![0u8; XATTR_SIZE_MAX];
    let len = rustix::fs::lgetxattr(path, name, &mut buf[..])?;
    buf.truncate(len);
    Ok(buf)
}

/// Sets `path`'s extended attribute `name` to `value`, as `mode` says.
pub fn set(path: &Path, name: &[u8], value: &[u8], mode: XattrSetMode) -> io::Result<()> {
    let flags = match mode {
        XattrSetMode::Any => XattrFlags::empty(),
        XattrSetMode::Create => XattrFlags::CREATE,
        XattrSetMode::Replace => XattrFlags::REPLACE,
    };
    Ok(rustix::fs::lsetxattr(path, name, value, flags)?)
}

/// Removes `path`'s extended attribute `name` (`ENODATA` if it has none).
pub fn remove(path: &Path, name: &[u8]) -> io::Result<()> {
    Ok(rustix::fs::lremovexattr(path, name)?)
}

/// Gives `to` every carried extended attribute of `from` (both entries themselves),
/// stopping at the first failure.
pub fn copy_all(from: &Path, to: &Path) -> io::Result<()> {
    for name in list(from)? {
        set(to, &name, &get(from, &name)?, XattrSetMode::Any)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_outside_the_carried_namespaces_or_limits_are_refused() {
        assert_eq!(check_name(b"user.a"), Ok(()));
        assert_eq!(check_name(b"trusted.x"), Ok(()));
        assert_eq!(check_name(b"security.selinux"), Ok(()));
        assert_eq!(
            check_name(b"system.posix_acl_access"),
            Err(NameError::Namespace)
        );
        assert_eq!(check_name(b"other.a"), Err(NameError::Namespace));
        assert_eq!(check_name(b"user."), Err(NameError::Invalid));
        assert_eq!(check_name(b"user.a\0b"), Err(NameError::Invalid));
        let long = [b"user.".as_slice(), &[b'n'; 251]].concat();
        assert_eq!(check_name(&long), Err(NameError::TooLong(256)));
        assert_eq!(check_name(&long[..255]), Ok(()));
    }

    #[test]
    fn set_get_list_remove_on_the_entry_itself() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("f");
        std::fs::write(&f, b"x").unwrap();
        if set(&f, b"user.k", b"v1", XattrSetMode::Any).is_err() {
            return; // A file system without user xattrs (tmpfs before 6.6).
        }
        assert_eq!(get(&f, b"user.k").unwrap(), b"v1");
        let e = set(&f, b"user.k", b"v2", XattrSetMode::Create).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::AlreadyExists);
        set(&f, b"user.k", b"v2", XattrSetMode::Replace).unwrap();
        assert_eq!(get(&f, b"user.k").unwrap(), b"v2");
        assert_eq!(list(&f).unwrap(), vec![b"user.k".to_vec()]);
        remove(&f, b"user.k").unwrap();
        let e = get(&f, b"user.k").unwrap_err();
        assert_eq!(
            e.raw_os_error(),
            Some(rustix::io::Errno::NODATA.raw_os_error())
        );
        let e = set(&f, b"user.k", b"v", XattrSetMode::Replace).unwrap_err();
        assert_eq!(
            e.raw_os_error(),
            Some(rustix::io::Errno::NODATA.raw_os_error())
        );
    }
}
