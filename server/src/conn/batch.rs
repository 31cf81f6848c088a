//! Batch requests: many small files moved by one one-sided operation each way. The
//! session has checked an upload batch as a whole (its file count, sizes and region).

use std::sync::Arc;

use ferry_common::msg::{BatchedFile, RemoteError, Request, Response};

use super::{misrouted, Conn};
use crate::batch::{self, BatchIo};

/// Performs one batch request; a file that failed is answered in its entry.
pub(super) async fn perform(conn: &Arc<Conn>, body: Request) -> Result<Response, RemoteError> {
    let file_max = conn.session().conn().batch_file_max();
    let share = match body.share() {
        Some(name) => conn.share(name)?,
        None => return Err(misrouted(&body).into()),
    };
    let io = BatchIo {
        transport: &conn.transport,
        pool: &conn.pool,
        chunk_bytes: conn.server.chunk_bytes,
        file_max,
        hashing: conn.hashing(&share)?,
        cache: &conn.server.manifests,
    };
    match body {
        Request::UploadBatch {
            region,
            algorithm,
            files,
            ..
        } => {
            let results = batch::upload(io, share, region, algorithm, files).await?;
            Ok(Response::UploadedBatch {
                results: results
                    .into_iter()
                    .map(|r| r.map(RemoteError::from))
                    .collect(),
            })
        }
        Request::DownloadBatch { paths, region, .. } => {
            let files = batch::download(io, share, paths, region).await?;
            Ok(Response::DownloadedBatch {
                files: files
                    .into_iter()
                    .map(|f| f.unwrap_or_else(|e| BatchedFile::Err(e.into())))
                    .collect(),
            })
        }
        other => Err(misrouted(&other).into()),
    }
}
