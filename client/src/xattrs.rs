//! The requests of the `xattr` capability: extended attributes of an entry itself on
//! the server (a final symlink never followed), for a mount and for `rcp -X`.

use ferry_common::msg::{Request, Response, XattrSetMode};

use crate::client::{expect_ok, unexpected, Client};
use crate::error::ClientError;

impl Client {
    /// Whether the session negotiated the `xattr` capability, without which the
    /// requests below are refused unsent.
    pub fn has_xattr(&self) -> bool {
        self.negotiated().is_some_and(|n| n.xattr)
    }

    /// The value of `path`'s extended attribute `name` (`NoAttribute` if none).
    pub async fn xattr_get(
        &self,
        share: &str,
        path: &str,
        name: &[u8],
    ) -> Result<Vec<u8>, ClientError> {
        let req = Request::XattrGet {
            share: share.into(),
            path: path.into(),
            name: name.to_vec(),
        };
        match self.call(req).await? {
            Response::XattrValue { value } => Ok(value),
            other => Err(unexpected(other)),
        }
    }

    /// The names of `path`'s extended attributes the server shows.
    pub async fn xattr_list(&self, share: &str, path: &str) -> Result<Vec<Vec<u8>>, ClientError> {
        let req = Request::XattrList {
            share: share.into(),
            path: path.into(),
        };
        match self.call(req).await? {
            Response::XattrNames { names } => Ok(names),
            other => Err(unexpected(other)),
        }
    }

    /// Sets `path`'s extended attribute `name` to `value` as `mode` says.
    pub async fn xattr_set(
        &self,
        share: &str,
        path: &str,
        name: &[u8],
        value: &[u8],
        mode: XattrSetMode,
    ) -> Result<(), ClientError> {
        let req = Request::XattrSet {
            share: share.into(),
            path: path.into(),
            name: name.to_vec(),
            value: value.to_vec(),
            mode,
        };
        self.call(req).await.and_then(expect_ok)
    }

    /// Removes `path`'s extended attribute `name` (`NoAttribute` if none).
    pub async fn xattr_remove(
        &self,
        share: &str,
        path: &str,
        name: &[u8],
    ) -> Result<(), ClientError> {
        let req = Request::XattrRemove {
            share: share.into(),
            path: path.into(),
            name: name.to_vec(),
        };
        self.call(req).await.and_then(expect_ok)
    }
}
