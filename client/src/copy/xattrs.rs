//! `rcp -X`: extended attributes carried with a copy, as `rsync -X` and
//! `cp --preserve=xattr` do. Once every entry's content is in place, each copied tree
//! is walked on the local side (the sources of an upload, the copies a download made;
//! symlinks not followed) and every entry's attributes are set on the other side, on
//! the entry itself, over any of the same name. Names the protocol does not carry
//! ([`ferry_common::xattr::check_name`]: `system.*` ACLs) stay behind. Attributes the
//! receiving side already had and the sending side lacks are kept.

use std::fs;
use std::path::{Path, PathBuf};

use ferry_common::msg::XattrSetMode;
use ferry_common::xattr;

use crate::client::Client;
use crate::error::ClientError;
use crate::location::Remote;
use crate::walk::join;

use super::report::Shared;

/// The entries of the local tree `root` (itself first, then below it, a symlink
/// not followed), each with its path relative to `root` ("" for `root`). Names that
/// are not UTF-8 are left out (the copy left them out too).
fn entries(root: &Path) -> Vec<(PathBuf, String)> {
    let mut out = vec![(root.to_path_buf(), String::new())];
    let mut next = 0;
    while next < out.len() {
        let (path, rel) = out[next].clone();
        next += 1;
        // An unreadable directory is the copy's own failure, recorded there.
        if !fs::symlink_metadata(&path).is_ok_and(|m| m.is_dir()) {
            continue;
        }
        let Ok(dir) = fs::read_dir(&path) else {
            continue;
        };
        for e in dir.flatten() {
            if let Some(name) = e.file_name().to_str() {
                out.push((e.path(), join(&rel, name)));
            }
        }
    }
    out
}

/// Fails the copy's attributes when the session cannot carry them.
fn carried(client: &Client, dest: String, shared: &Shared) -> bool {
    let ok = client.has_xattr();
    if !ok {
        let why = "extended attributes not copied (-X): the server does not carry them \
                   (it is older than the xattr capability)";
        shared.fail(dest, ClientError::Usage(why.into()));
    }
    ok
}

/// Sets, on the server, the attributes of each local source tree of `roots` (local
/// source, share-relative target) at its target.
pub(super) async fn upload_xattrs(
    client: &Client,
    dest: &Remote,
    roots: &[(PathBuf, String)],
    shared: &Shared,
) {
    if !carried(client, dest.display(), shared) {
        return;
    }
    for (src, target) in roots {
        for (path, rel) in entries(src) {
            let names = match xattr::list(&path) {
                Ok(n) => n,
                Err(e) => {
                    let err = ClientError::local(&path, "cannot list extended attributes", e);
                    shared.fail(path.display().to_string(), err);
                    continue;
                }
            };
            let at = join(target, &rel);
            for name in names {
                let sent = match xattr::get(&path, &name) {
                    Ok(value) => {
                        let mode = XattrSetMode::Any;
                        client
                            .xattr_set(&dest.share, &at, &name, &value, mode)
                            .await
                    }
                    Err(e) => Err(ClientError::local(
                        &path,
                        "cannot read extended attribute",
                        e,
                    )),
                };
                if let Err(e) = sent {
                    shared.fail(dest.with_path(at.clone()).display(), e);
                }
            }
        }
    }
}

/// Sets, on the local copies, the attributes of the server entries each came from:
/// `roots` are (server source, local target) pairs.
pub(super) async fn download_xattrs(client: &Client, roots: &[(Remote, PathBuf)], shared: &Shared) {
    let Some((first, _)) = roots.first() else {
        return;
    };
    if !carried(client, first.display(), shared) {
        return;
    }
    for (src, target) in roots {
        for (path, rel) in entries(target) {
            let from = src.with_path(join(&src.path, &rel));
            let names = match client.xattr_list(&from.share, &from.path).await {
                Ok(n) => n,
                Err(e) => {
                    shared.fail(from.display(), e);
                    continue;
                }
            };
            for name in names {
                let got = client.xattr_get(&from.share, &from.path, &name).await;
                let set = got.and_then(|value| {
                    xattr::set(&path, &name, &value, XattrSetMode::Any)
                        .map_err(|e| ClientError::local(&path, "cannot set extended attribute", e))
                });
                if let Err(e) = set {
                    shared.fail(path.display().to_string(), e);
                }
            }
        }
    }
}
