//! File-handle requests (the `write` capability): each finds the handle's I/O state
//! in the connection's table ([`crate::files::OpenFile`], by the handle the session
//! granted) and runs the request in [`crate::files`].
//!
//! A `FileOpen`'s handle enters the table before its answer is queued, so a request
//! naming it (which the session admits only after the answer) always finds it. A
//! `FileClose` takes the handle out of the table before it syncs: the session has
//! already forgotten the handle, and a staged file whose commit fails is removed when
//! the last request using it lets go.

use std::sync::Arc;

use ferry_common::msg::{
    Extent, Hash256, HashAlgorithm, RegionDesc, RemoteError, Request, Response, SetAttrs,
};
use ferry_common::proto::conn::Grant;

use super::blocking::blocking;
use super::{misrouted, Conn, ConnError};
use crate::files::{self, OpenFile};
use crate::share::Share;

/// Performs one file-handle request, under the handle `grant` names.
pub(super) async fn perform(
    conn: &Arc<Conn>,
    body: Request,
    grant: Grant,
) -> Result<Response, RemoteError> {
    if let Request::FilePut {
        share,
        path,
        mode,
        exclusive,
        region,
        algorithm,
        extents,
        hashes,
        attrs,
    } = body
    {
        let write = (region, algorithm, extents, hashes);
        return put(conn, (share, path, mode, exclusive), write, attrs).await;
    }
    let Grant::File(handle) = grant else {
        return Err(misrouted(&body).into());
    };
    match body {
        Request::FileOpen {
            share,
            path,
            create,
            exclusive,
            truncate,
        } => open(conn, handle, (share, path), create, exclusive, truncate).await,
        Request::FileWrite { .. } | Request::FileFinish { .. } | Request::FileRead { .. } => {
            move_data(conn, handle, body).await
        }
        other => on_file(conn, handle, other).await,
    }
}

/// `FileOpen`: opens (or creates, or stages) the file and enters it in the
/// connection's table under `handle` before the answer is queued.
async fn open(
    conn: &Arc<Conn>,
    handle: u64,
    (share, path): (String, String),
    create: Option<u32>,
    exclusive: bool,
    truncate: bool,
) -> Result<Response, RemoteError> {
    let share = conn.share(&share)?;
    let (chunk_bytes, manifests) = (conn.server.chunk_bytes, conn.server.manifests.clone());
    let opened = blocking(move || {
        let f = files::open(
            share,
            &path,
            create,
            exclusive,
            truncate,
            chunk_bytes,
            manifests,
        )?;
        let attr = f.attr()?;
        Ok::<_, files::FileError>((f, attr))
    })
    .await?;
    let (file, attr) = opened;
    let staged = file.staged();
    conn.files().insert(handle, Arc::new(file));
    Ok(Response::FileOpened {
        handle,
        attr,
        staged,
    })
}

/// The requests that move bytes through the open file `handle` (`FileWrite`,
/// `FileFinish`, `FileRead`); a write's hashes must be in the share's algorithm.
async fn move_data(conn: &Arc<Conn>, handle: u64, body: Request) -> Result<Response, RemoteError> {
    let file = conn.file(handle)?;
    match body {
        Request::FileWrite {
            region,
            algorithm,
            extents,
            hashes,
            ..
        } => {
            check_algorithm(conn, file.share(), file.what(), algorithm)?;
            Ok(file
                .write(&conn.file_io(), region, algorithm, extents, hashes)
                .await?)
        }
        Request::FileFinish {
            region,
            algorithm,
            extents,
            hashes,
            attrs,
            commit,
            ..
        } => {
            if !extents.is_empty() {
                check_algorithm(conn, file.share(), file.what(), algorithm)?;
            }
            let write = (region, algorithm, extents, hashes);
            Ok(file.finish(&conn.file_io(), write, attrs, commit).await?)
        }
        Request::FileRead { offset, region, .. } => {
            let algorithm = conn.hashing(file.share())?.fresh;
            Ok(file
                .read(&conn.transport, &conn.pool, offset, region, algorithm)
                .await?)
        }
        other => Err(misrouted(&other).into()),
    }
}

/// The requests that act on the open file `handle` without moving data, each on a
/// blocking thread; `FileClose` and `FileDiscard` take it out of the table first.
async fn on_file(conn: &Arc<Conn>, handle: u64, body: Request) -> Result<Response, RemoteError> {
    match body {
        Request::FileSetAttr { attrs, .. } => {
            let file = conn.file(handle)?;
            blocking(move || file.set_attrs(&attrs)).await
        }
        Request::FileAllocate {
            offset,
            len,
            keep_size,
            ..
        } => {
            let file = conn.file(handle)?;
            blocking(move || file.allocate(offset, len, keep_size)).await
        }
        Request::FileFallocate {
            offset, len, mode, ..
        } => {
            let file = conn.file(handle)?;
            blocking(move || file.change_range(offset, len, mode)).await
        }
        Request::FileSync { data_only, .. } => {
            let file = conn.file(handle)?;
            blocking(move || file.sync(data_only)).await
        }
        Request::FileClose { .. } => {
            let file = conn.take_file(handle)?;
            blocking(move || file.close()).await
        }
        Request::FileCommit { .. } => {
            let file = conn.file(handle)?;
            blocking(move || file.publish()).await
        }
        Request::FileDiscard { .. } => {
            let file = conn.take_file(handle)?;
            // The last reference drops off the async threads: a staged file is
            // unlinked then.
            blocking(move || {
                drop(file);
                Ok::<_, ConnError>(Response::Ok)
            })
            .await
        }
        other => Err(misrouted(&other).into()),
    }
}

/// `FilePut`: a new staged file (as `FileOpen` with `create` and `truncate`), written,
/// its attributes set and named (as `FileFinish` with `commit`), with no handle left.
/// The bytes of a small file are pulled while the file is being made.
async fn put(
    conn: &Arc<Conn>,
    (share_name, path, mode, exclusive): (String, String, u32, bool),
    write: (RegionDesc, HashAlgorithm, Vec<Extent>, Vec<Hash256>),
    attrs: SetAttrs,
) -> Result<Response, RemoteError> {
    let what = format!("{share_name}/{path}");
    let share = conn.share(&share_name)?;
    if !write.2.is_empty() {
        check_algorithm(conn, &share, &what, write.1)?;
    }
    let (chunk_bytes, manifests) = (conn.server.chunk_bytes, conn.server.manifests.clone());
    let io = conn.file_io();
    let staged = files::Staged::of(write, chunk_bytes);
    let open = blocking(move || {
        files::open(
            share,
            &path,
            Some(mode),
            exclusive,
            true,
            chunk_bytes,
            manifests,
        )
    });
    let (file, pulled) = tokio::join!(open, staged.pull(&what, &io));
    let file = Arc::new(file?);
    Ok(file.finish_pulled(&io, staged, pulled, attrs, true).await?)
}

/// Fails unless `algorithm`, a write's hashes', is the one `share` hashes its data in
/// for this session ([`Conn::hashing`]: the share's own if its configuration fixes
/// one, else the session's), so a share kept on SHA-256 takes no BLAKE3 writes through
/// a mount either; `what` names the file.
fn check_algorithm(
    conn: &Conn,
    share: &Share,
    what: &str,
    algorithm: HashAlgorithm,
) -> Result<(), RemoteError> {
    let wanted = conn.hashing(share)?.fresh;
    if algorithm == wanted {
        Ok(())
    } else {
        Err(files::FileError::Algorithm {
            path: what.into(),
            algorithm,
            wanted,
        }
        .into())
    }
}

impl Conn {
    fn file_io(&self) -> files::FileIo {
        files::FileIo {
            transport: self.transport.clone(),
            pool: self.pool.clone(),
            traffic: self.server.traffic.clone(),
        }
    }

    fn file(&self, handle: u64) -> Result<Arc<OpenFile>, ConnError> {
        self.files()
            .get(&handle)
            .cloned()
            .ok_or(ConnError::NoFile { handle })
    }

    /// Takes the open file `handle` out of the connection's table.
    fn take_file(&self, handle: u64) -> Result<Arc<OpenFile>, ConnError> {
        self.files()
            .remove(&handle)
            .ok_or(ConnError::NoFile { handle })
    }
}
