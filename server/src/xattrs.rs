//! Extended-attribute requests (the `xattr` capability): the value, the names, a
//! change and a removal of the extended attributes of an entry itself (a final
//! symlink is never followed). Blocking.
//!
//! Paths resolve as every other request's: reads through [`Share::resolve`] without
//! following the final component, changes through [`Share::resolve_for_write`] (a
//! read-only share, the share root, the state directory and temporary names refused).
//! Only the names [`ferry_common::xattr::check_name`] accepts are read, listed or
//! changed; what the kernel allows beyond that (`trusted.*` only to a ferryd running as
//! root) is its own answer.

use std::io;

use ferry_common::msg::XattrSetMode;
use ferry_common::xattr::{self, NameError};

use crate::share::{Share, ShareError};

/// Why an extended-attribute request failed.
#[derive(Debug, thiserror::Error)]
pub enum XattrError {
    /// The path cannot be used.
    #[error(transparent)]
    Share(#[from] ShareError),
    /// The name is not one the protocol carries.
    #[error("{path}: {source}")]
    Name {
        /// Share-relative path, for messages.
        path: String,
        /// Why.
        source: NameError,
    },
    /// The file system refused.
    #[error("{path}: cannot {op} extended attribute {name}")]
    Io {
        /// Share-relative path, for messages.
        path: String,
        /// What was tried ("read", "list", "set", "remove").
        op: &'static str,
        /// The attribute's name, lossily as text.
        name: String,
        /// The OS error.
        source: io::Error,
    },
}

/// The name checked, or the error naming `rel`.
fn checked(share: &Share, rel: &str, name: &[u8]) -> Result<(), XattrError> {
    xattr::check_name(name).map_err(|source| XattrError::Name {
        path: share.display(rel),
        source,
    })
}

/// A mapper of an OS error of `op` on `rel`'s attribute `name` into [`XattrError::Io`].
fn failed<'a>(
    share: &'a Share,
    rel: &'a str,
    op: &'static str,
    name: &'a [u8],
) -> impl FnOnce(io::Error) -> XattrError + 'a {
    move |source| XattrError::Io {
        path: share.display(rel),
        op,
        name: String::from_utf8_lossy(name).into_owned(),
        source,
    }
}

/// `XattrGet`: the value of `rel`'s attribute `name`.
pub fn get(share: &Share, rel: &str, name: &[u8]) -> Result<Vec<u8>, XattrError> {
    checked(share, rel, name)?;
    let path = share.resolve(rel, false)?;
    xattr::get(&path, name).map_err(failed(share, rel, "read", name))
}

/// `XattrList`: the carried names of `rel`'s attributes.
pub fn list(share: &Share, rel: &str) -> Result<Vec<Vec<u8>>, XattrError> {
    let path = share.resolve(rel, false)?;
    xattr::list(&path).map_err(failed(share, rel, "list", b""))
}

/// `XattrSet`: `rel`'s attribute `name` set to `value` as `mode` says.
pub fn set(
    share: &Share,
    rel: &str,
    name: &[u8],
    value: &[u8],
    mode: XattrSetMode,
) -> Result<(), XattrError> {
    checked(share, rel, name)?;
    let path = share.resolve_for_write(rel)?;
    xattr::set(&path, name, value, mode).map_err(failed(share, rel, "set", name))
}

/// `XattrRemove`: `rel`'s attribute `name` removed.
pub fn remove(share: &Share, rel: &str, name: &[u8]) -> Result<(), XattrError> {
    checked(share, rel, name)?;
    let path = share.resolve_for_write(rel)?;
    xattr::remove(&path, name).map_err(failed(share, rel, "remove", name))
}
