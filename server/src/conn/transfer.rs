//! Transfer requests: open an upload or a download, move its windows by one-sided
//! operations, commit or close it. The session's tables have already checked that a
//! named transfer is open and of the right kind, and granted a new one its id.

use std::sync::Arc;

use ferry_common::msg::{RemoteError, Request, Response};
use ferry_common::proto::conn::Grant;

use super::blocking::blocking;
use super::{misrouted, Conn, ConnError, OpenTransfer};
use crate::transfer::{BaseFile, Download, Transfer, TransferError, Upload};

/// Performs one transfer request.
pub(super) async fn perform(
    conn: &Arc<Conn>,
    body: Request,
    grant: Grant,
) -> Result<Response, RemoteError> {
    let Grant::Transfer(id) = grant else {
        return Err(misrouted(&body).into());
    };
    match body {
        Request::UploadOpen { .. }
        | Request::UploadOpenBase { .. }
        | Request::DownloadOpen { .. } => open(conn, id, body).await,
        Request::UploadWindow { .. } | Request::DownloadWindow { .. } => {
            move_window(conn, id, body).await
        }
        Request::UploadCommit { .. } | Request::Close { .. } => finish(conn, id, body).await,
        other => Err(misrouted(&other).into()),
    }
}

/// Opens an upload or a download as transfer `id`, the id the session granted.
async fn open(conn: &Arc<Conn>, id: u64, body: Request) -> Result<Response, RemoteError> {
    let chunk_bytes = conn.server.chunk_bytes;
    match body {
        Request::UploadOpen {
            share,
            path,
            size,
            mode,
            mtime,
        } => {
            let share = conn.share(&share)?;
            let hashing = conn.hashing(&share)?;
            let up = blocking(move || {
                Upload::open(&share, &path, size, mode, mtime, chunk_bytes, None, hashing)
            })
            .await?;
            let algorithm = up.algorithm();
            conn.insert_transfer(id, Transfer::Upload(Box::new(up)));
            Ok(Response::UploadOpened {
                transfer: id,
                algorithm,
            })
        }
        Request::UploadOpenBase {
            share,
            path,
            size,
            mode,
            mtime,
            base,
        } => {
            let share = conn.share(&share)?;
            let hashing = conn.hashing(&share)?;
            let server = conn.server.clone();
            let up = blocking(move || {
                share.check_writable()?;
                let base = BaseFile::open(&share, &base, chunk_bytes, &server.manifests, hashing)?;
                Upload::open(
                    &share,
                    &path,
                    size,
                    mode,
                    mtime,
                    chunk_bytes,
                    Some(base),
                    hashing,
                )
            })
            .await?;
            let algorithm = up.algorithm();
            conn.insert_transfer(id, Transfer::Upload(Box::new(up)));
            Ok(Response::UploadOpened {
                transfer: id,
                algorithm,
            })
        }
        Request::DownloadOpen { share, path } => {
            let share = conn.share(&share)?;
            let hashing = conn.hashing(&share)?;
            let server = conn.server.clone();
            let down = blocking(move || {
                Download::open(&share, &path, chunk_bytes, hashing, &server.manifests)
            })
            .await?;
            let (attr, algorithm) = (down.attr().clone(), down.algorithm());
            conn.insert_transfer(id, Transfer::Download(Box::new(down)));
            Ok(Response::DownloadOpened {
                transfer: id,
                attr,
                algorithm,
            })
        }
        other => Err(misrouted(&other).into()),
    }
}

/// Moves one window of transfer `id` by a one-sided operation.
async fn move_window(conn: &Arc<Conn>, id: u64, body: Request) -> Result<Response, RemoteError> {
    match body {
        Request::UploadWindow {
            offset,
            region,
            hashes,
            ..
        } => match &conn.transfer(id)?.transfer {
            Transfer::Upload(up) => Ok(up
                .pull_window(&conn.transport, &conn.pool, offset, region, hashes)
                .await?),
            Transfer::Download(_) => Err(ConnError::WrongKind { transfer: id }.into()),
        },
        Request::DownloadWindow {
            offset,
            region,
            verify,
            ..
        } => match &conn.transfer(id)?.transfer {
            Transfer::Download(down) => Ok(down
                .push_window(&conn.transport, &conn.pool, offset, region, verify)
                .await?),
            Transfer::Upload(_) => Err(ConnError::WrongKind { transfer: id }.into()),
        },
        other => Err(misrouted(&other).into()),
    }
}

/// Commits or closes transfer `id`; either way it leaves the connection.
async fn finish(conn: &Arc<Conn>, id: u64, body: Request) -> Result<Response, RemoteError> {
    match body {
        Request::UploadCommit { manifest, .. } => {
            let t = conn.transfer(id)?;
            let response = blocking(move || -> Result<Response, RemoteError> {
                match &t.transfer {
                    Transfer::Upload(up) => Ok(up.commit(&manifest)?),
                    Transfer::Download(_) => Err(ConnError::WrongKind { transfer: id }.into()),
                }
            })
            .await?;
            conn.transfers().remove(&id);
            Ok(response)
        }
        Request::Close { .. } => {
            let t = conn
                .transfers()
                .remove(&id)
                .ok_or_else(|| ConnError::NoState { transfer: id })?;
            blocking(move || match &t.transfer {
                Transfer::Download(down) => down.close(),
                // The client gave up on the upload: nothing of it is kept.
                Transfer::Upload(up) => {
                    up.discard();
                    Ok::<_, TransferError>(Response::Ok)
                }
            })
            .await
        }
        other => Err(misrouted(&other).into()),
    }
}

impl Conn {
    /// Keeps the I/O state of transfer `id`, counted in the server's open transfers.
    fn insert_transfer(&self, id: u64, t: Transfer) {
        let open = OpenTransfer {
            transfer: t,
            _counted: self.server.transfers.hold(1),
        };
        self.transfers().insert(id, Arc::new(open));
    }

    fn transfer(&self, id: u64) -> Result<Arc<OpenTransfer>, ConnError> {
        self.transfers()
            .get(&id)
            .cloned()
            .ok_or_else(|| ConnError::NoState { transfer: id })
    }
}
