//! Transfer requests: open an upload or a download, move its windows by one-sided
//! operations, commit or close it. The session's tables have already checked that a
//! named transfer is open and of the right kind, and granted a new one its id.

use std::sync::Arc;

use ferry_common::msg::{ErrorKind, RemoteError, Request, Response};
use ferry_common::proto::conn::Grant;

use super::{misrouted, Conn, OpenTransfer};
use crate::blocking::blocking;
use crate::error::remote;
use crate::transfer::{BaseFile, Download, Transfer, Upload};

/// Performs one transfer request.
pub(super) async fn perform(
    conn: &Arc<Conn>,
    body: Request,
    grant: Grant,
) -> Result<Response, RemoteError> {
    let Grant::Transfer(id) = grant else {
        return Err(misrouted(&body));
    };
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
            let up =
                blocking(move || Upload::open(&share, &path, size, mode, mtime, chunk_bytes, None))
                    .await?;
            conn.insert_transfer(id, Transfer::Upload(Box::new(up)));
            Ok(Response::UploadOpened { transfer: id })
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
            let server = conn.server.clone();
            let up = blocking(move || {
                share.check_writable()?;
                let base = BaseFile::open(&share, &base, chunk_bytes, &server.manifests)?;
                Upload::open(&share, &path, size, mode, mtime, chunk_bytes, Some(base))
            })
            .await?;
            conn.insert_transfer(id, Transfer::Upload(Box::new(up)));
            Ok(Response::UploadOpened { transfer: id })
        }
        Request::DownloadOpen { share, path } => {
            let share = conn.share(&share)?;
            let down = blocking(move || Download::open(&share, &path, chunk_bytes)).await?;
            let attr = down.attr().clone();
            conn.insert_transfer(id, Transfer::Download(down));
            Ok(Response::DownloadOpened { transfer: id, attr })
        }
        Request::UploadWindow {
            offset,
            region,
            hashes,
            ..
        } => match &conn.transfer(id)?.transfer {
            Transfer::Upload(up) => {
                up.pull_window(&conn.transport, &conn.pool, offset, region, hashes)
                    .await
            }
            Transfer::Download(_) => Err(wrong_kind(id)),
        },
        Request::DownloadWindow { offset, region, .. } => match &conn.transfer(id)?.transfer {
            Transfer::Download(down) => {
                down.push_window(&conn.transport, &conn.pool, offset, region)
                    .await
            }
            Transfer::Upload(_) => Err(wrong_kind(id)),
        },
        Request::UploadCommit { manifest, .. } => {
            let t = conn.transfer(id)?;
            let response = blocking(move || match &t.transfer {
                Transfer::Upload(up) => up.commit(&manifest),
                Transfer::Download(_) => Err(wrong_kind(id)),
            })
            .await?;
            conn.transfers().remove(&id);
            Ok(response)
        }
        Request::Close { .. } => {
            let t = conn.transfers().remove(&id).ok_or_else(|| no_state(id))?;
            blocking(move || match &t.transfer {
                Transfer::Download(down) => down.close(),
                // The client gave up on the upload: nothing of it is kept.
                Transfer::Upload(up) => {
                    up.discard();
                    Ok(Response::Ok)
                }
            })
            .await
        }
        other => Err(misrouted(&other)),
    }
}

/// The error for a transfer the session's tables hold but the driver has no state for:
/// a bug, answered rather than panicking.
fn no_state(id: u64) -> RemoteError {
    remote(ErrorKind::Protocol, format!("no open transfer {id}"))
}

/// The error for a transfer whose I/O state is not of the kind the session's tables
/// admitted the request for: a bug, answered rather than panicking.
fn wrong_kind(id: u64) -> RemoteError {
    remote(
        ErrorKind::Protocol,
        format!("transfer {id} is not of the kind its request needs"),
    )
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

    fn transfer(&self, id: u64) -> Result<Arc<OpenTransfer>, RemoteError> {
        self.transfers()
            .get(&id)
            .cloned()
            .ok_or_else(|| no_state(id))
    }
}
