//! Namespace requests: attributes (owners and symlink mtimes included), listings,
//! directories, symlinks, links, renames, removals and space, each one blocking
//! filesystem call (or one batch of them) in the share; and those of the `write`
//! capability that name paths (`Move`, `SetAttrs`, `ShareAccess`); and the directory
//! batches of the `dirs` capability (`MakeDirs`, `SetAttrBatch`); the requests of the
//! `xattr` capability (`XattrGet`, `XattrList`, `XattrSet`, `XattrRemove`); and the
//! `posix` capability's `MakeNode` and `SetTimes` ([`crate::nodes`]).

use std::sync::Arc;

use ferry_common::msg::{RemoteError, Request, Response};

use super::blocking::blocking;
use super::{misrouted, Conn};
use crate::share::Share;
use crate::{dirs, du, files, fsops, links, meta, nodes, remove, xattrs};

/// Performs one namespace request.
pub(super) async fn perform(conn: &Arc<Conn>, body: Request) -> Result<Response, RemoteError> {
    let share = match body.share() {
        Some(name) => conn.share(name)?,
        None => return Err(misrouted(&body).into()),
    };
    if let Request::ShareInfo { .. } = body {
        return Ok(Response::ShareInfo {
            algorithm: conn.hashing(&share)?.fresh,
        });
    }
    if let Request::ShareAccess { .. } = body {
        return Ok(Response::ShareAccess {
            writable: !share.read_only(),
        });
    }
    let manifests = conn.server.manifests.clone();
    blocking(move || -> Result<Response, RemoteError> {
        Ok(match body {
            Request::Stat { path, follow, .. } => fsops::stat(&share, &path, follow)?,
            Request::StatMeta { path, follow, .. } => fsops::stat_meta(&share, &path, follow)?,
            Request::ListDir { path, cursor, .. } => fsops::list_dir(&share, &path, cursor)?,
            Request::ListDirMeta { path, cursor, .. } => {
                fsops::list_dir_meta(&share, &path, cursor)?
            }
            body @ (Request::SetMeta { .. }
            | Request::MakeDirs { .. }
            | Request::SetAttrBatch { .. }
            | Request::LinkBatch { .. }) => batch(&share, body)?,
            Request::Mkdir {
                path,
                mode,
                exist_ok,
                ..
            } => fsops::mkdir(&share, &path, mode, exist_ok)?,
            Request::Symlink { path, target, .. } => fsops::make_symlink(&share, &path, &target)?,
            Request::SetAttr {
                path, mode, mtime, ..
            } => fsops::set_attr(&share, &path, mode, mtime)?,
            Request::Link { from, to, .. } => links::link(&share, &from, &to)?,
            Request::Rename { from, to, .. } => fsops::rename(&share, &from, &to)?,
            Request::Remove {
                path, recursive, ..
            } => remove::remove(&share, &path, recursive)?,
            Request::StatFs { .. } => fsops::statfs(&share)?,
            Request::DiskUsage { path, .. } => du::disk_usage(&share, &path)?,
            Request::Move {
                from,
                to,
                no_replace,
                ..
            } => files::move_entry(&share, &from, &to, no_replace)?,
            Request::SetAttrs { path, attrs, .. } => {
                files::set_attrs(&share, &path, &attrs, &manifests)?
            }
            body @ (Request::XattrGet { .. }
            | Request::XattrList { .. }
            | Request::XattrSet { .. }
            | Request::XattrRemove { .. }) => xattr(&share, body)?,
            Request::MakeNode {
                path,
                kind,
                mode,
                rdev,
                ..
            } => nodes::make_node(&share, &path, kind, mode, rdev)?,
            Request::SetTimes {
                path, atime, mtime, ..
            } => nodes::set_times(&share, &path, atime, mtime)?,
            other => return Err(misrouted(&other).into()),
        })
    })
    .await
}

/// Performs one request that applies a batch of changes (`SetMeta`, `MakeDirs`,
/// `SetAttrBatch`, `LinkBatch`): each change is answered on its own.
fn batch(share: &Share, body: Request) -> Result<Response, RemoteError> {
    Ok(match body {
        Request::SetMeta { entries, .. } => Response::MetaSet {
            results: each_result(meta::set_meta(share, entries, owners_apply())),
        },
        Request::MakeDirs { dirs, .. } => Response::MetaSet {
            results: each_result(dirs::make_dirs(share, &dirs)),
        },
        Request::SetAttrBatch { entries, .. } => Response::MetaSet {
            results: each_result(dirs::set_attr_batch(share, &entries, owners_apply())),
        },
        Request::LinkBatch { links, .. } => Response::LinkedBatch {
            results: links::link_batch(share, &links)
                .into_iter()
                .map(|r| r.map(RemoteError::from))
                .collect(),
        },
        other => return Err(misrouted(&other).into()),
    })
}

/// Whether a batch sets owners: the server applies them and acts for no
/// unprivileged caller.
fn owners_apply() -> bool {
    meta::applies_owners() && !crate::owners::acting_unprivileged()
}

/// A batch's answers: `None` for each change made, else why it failed.
fn each_result<E: Into<RemoteError>>(results: Vec<Result<(), E>>) -> Vec<Option<RemoteError>> {
    results
        .into_iter()
        .map(|r| r.err().map(Into::into))
        .collect()
}

/// Performs one request of the `xattr` capability.
fn xattr(share: &Share, body: Request) -> Result<Response, RemoteError> {
    Ok(match body {
        Request::XattrGet { path, name, .. } => Response::XattrValue {
            value: xattrs::get(share, &path, &name)?,
        },
        Request::XattrList { path, .. } => Response::XattrNames {
            names: xattrs::list(share, &path)?,
        },
        Request::XattrSet {
            path,
            name,
            value,
            mode,
            ..
        } => {
            xattrs::set(share, &path, &name, &value, mode)?;
            Response::Ok
        }
        Request::XattrRemove { path, name, .. } => {
            xattrs::remove(share, &path, &name)?;
            Response::Ok
        }
        other => return Err(misrouted(&other).into()),
    })
}
