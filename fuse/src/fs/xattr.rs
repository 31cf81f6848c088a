//! Extended attributes through the mount (the `xattr` capability): every call asks
//! the server, so two mounts see each other's changes at once. The one exception is
//! the kernel's check for `security.capability` before each write: an absent answer
//! is kept per node for the attribute timeout (as attributes are), and dropped at any
//! change through this mount.
//!
//! A file created or truncated here that has not taken its name on the server yet
//! (staged) has none: reads answer so without asking; a change names it first.
//! Without the capability (an older server) every call answers `ENOSYS`, which tells
//! the kernel to stop asking (it then answers `EOPNOTSUPP` itself).

use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt;
use std::time::Instant;

use ferry_client::error::ClientError;
use ferry_common::msg::XattrSetMode;
use ferry_common::xattr::{check_name, NameError};
use fuser::{Errno, INodeNo, ReplyEmpty, ReplyXattr};

use super::{fail, lock, read_only, Inner, OpError};

/// The attribute the kernel reads before every write (to drop file capabilities).
const CAPABILITY: &[u8] = b"security.capability";

/// Nodes remembered without `security.capability` before the table is emptied.
const CAPABILITY_ABSENT_KEPT: usize = 100_000;

/// `name` checked as the protocol carries it, or the errno a local file system gives.
fn checked(name: &OsStr) -> Result<Vec<u8>, OpError> {
    let bytes = name.as_bytes();
    check_name(bytes).map_err(|e| {
        let errno = match e {
            NameError::TooLong(_) => Errno::ERANGE,
            NameError::Invalid => Errno::EINVAL,
            NameError::Namespace => Errno::EOPNOTSUPP,
        };
        OpError::new(errno, format!("{}: {e}", name.to_string_lossy()))
    })?;
    Ok(bytes.to_vec())
}

/// Answers a get or list of `size` bytes (0: the size asked) with `data`.
fn answer(reply: ReplyXattr, size: u32, data: &[u8]) {
    match u32::try_from(data.len()) {
        Ok(len) if size == 0 => reply.size(len),
        Ok(len) if len <= size => reply.data(data),
        _ => reply.error(Errno::ERANGE),
    }
}

/// The answer of a session without the capability.
fn unsupported() -> OpError {
    OpError::new(
        Errno::ENOSYS,
        "the server does not carry extended attributes",
    )
}

impl Inner {
    /// The share path of node `ino`, and whether it is staged (see the module's doc).
    fn xattr_path(&self, ino: INodeNo) -> Result<(String, bool), OpError> {
        let path = self.path_of(ino)?;
        let staged = lock(&self.staged).contains_key(&path);
        Ok((self.share_path(&path), staged))
    }

    /// Runs an extended-attribute call `f` (`None`: the session lacks the capability).
    async fn xattr_call<T, F, Fut>(&self, what: String, f: F) -> Result<T, OpError>
    where
        F: FnOnce(ferry_client::Client, String) -> Fut,
        Fut: std::future::Future<Output = Result<Option<T>, ClientError>>,
    {
        let share = self.share.clone();
        let got = self
            .remote
            .call(&what, |c| async move {
                if !c.client.has_xattr() {
                    return Ok(None);
                }
                f(c.client.clone(), share).await
            })
            .await?;
        got.ok_or_else(unsupported)
    }

    /// Whether `security.capability` of `ino` was found absent less than the
    /// attribute timeout ago.
    fn capability_absent(&self, ino: u64) -> bool {
        let ttl = self.opts.attr_ttl;
        lock(&self.no_capability)
            .get(&ino)
            .is_some_and(|at| at.elapsed() < ttl)
    }

    /// `getxattr`: the value of `name`, or its size with `size` 0.
    pub(super) async fn getxattr(&self, ino: INodeNo, name: &OsStr) -> Result<Vec<u8>, OpError> {
        let name = checked(name)?;
        let capability = name == CAPABILITY;
        if capability && self.capability_absent(ino.0) {
            return Err(OpError::new(Errno::ENODATA, "no security.capability"));
        }
        let (sp, staged) = self.xattr_path(ino)?;
        if staged {
            return Err(OpError::new(Errno::ENODATA, "a staged file has none"));
        }
        let what = format!("getxattr {}/{sp}", self.share);
        let got = self
            .xattr_call(what, |c, share| async move {
                c.xattr_get(&share, &sp, &name).await.map(Some)
            })
            .await;
        if capability && matches!(&got, Err(e) if e.errno == Errno::ENODATA) {
            let mut absent = lock(&self.no_capability);
            if absent.len() >= CAPABILITY_ABSENT_KEPT {
                // Bounded: the table refills from the next writes' checks.
                absent.clear();
            }
            absent.insert(ino.0, Instant::now());
        }
        got
    }

    /// `listxattr`: the names, each followed by a NUL.
    pub(super) async fn listxattr(&self, ino: INodeNo) -> Result<Vec<u8>, OpError> {
        let (sp, staged) = self.xattr_path(ino)?;
        if staged {
            return Ok(Vec::new());
        }
        let what = format!("listxattr {}/{sp}", self.share);
        let names = self
            .xattr_call(what, |c, share| async move {
                c.xattr_list(&share, &sp).await.map(Some)
            })
            .await?;
        Ok(names
            .into_iter()
            .flat_map(|mut n| {
                n.push(0);
                n
            })
            .collect())
    }

    /// `setxattr` (`value: Some`) or `removexattr` (`None`) of `name`.
    pub(super) async fn change_xattr(
        &self,
        ino: INodeNo,
        name: &OsStr,
        value: Option<(Vec<u8>, XattrSetMode)>,
    ) -> Result<(), OpError> {
        if !self.writable {
            return Err(read_only());
        }
        let name = checked(name)?;
        let path = self.path_of(ino)?;
        self.name_staged(&path).await?;
        lock(&self.no_capability).remove(&ino.0);
        let sp = self.share_path(&path);
        let what = format!(
            "{} {}/{sp}",
            if value.is_some() {
                "setxattr"
            } else {
                "removexattr"
            },
            self.share
        );
        let done = self
            .xattr_call(what, |c, share| async move {
                match value {
                    Some((v, mode)) => c.xattr_set(&share, &sp, &name, &v, mode).await,
                    None => c.xattr_remove(&share, &sp, &name).await,
                }
                .map(Some)
            })
            .await;
        // The change moved the node's ctime.
        lock(&self.nodes).changed(&path);
        done
    }
}

/// The set mode of `setxattr(2)`'s `flags`, or `EINVAL` for others.
pub(super) fn set_mode(flags: i32) -> Result<XattrSetMode, Errno> {
    const CREATE: i32 = 1;
    const REPLACE: i32 = 2;
    match flags {
        0 => Ok(XattrSetMode::Any),
        CREATE => Ok(XattrSetMode::Create),
        REPLACE => Ok(XattrSetMode::Replace),
        _ => Err(Errno::EINVAL),
    }
}

/// Replies to a get or list with its bytes (or their size) or its error.
pub(super) fn answer_xattr(op: &str, reply: ReplyXattr, size: u32, got: Result<Vec<u8>, OpError>) {
    match got {
        Ok(data) => answer(reply, size, &data),
        // An absent attribute is the normal course of things.
        Err(e) if e.errno == Errno::ENODATA || e.errno == Errno::ENOSYS => reply.error(e.errno),
        Err(e) => reply.error(fail(op, e)),
    }
}

/// Replies to a set or remove.
pub(super) fn answer_change(op: &str, reply: ReplyEmpty, got: Result<(), OpError>) {
    match got {
        Ok(()) => reply.ok(),
        Err(e) if e.errno == Errno::ENODATA || e.errno == Errno::EEXIST => reply.error(e.errno),
        Err(e) => reply.error(fail(op, e)),
    }
}
