//! Batch requests: many small files moved by one one-sided operation each way. The
//! session has checked an upload batch as a whole (its file count, sizes and region).

use std::sync::Arc;

use ferry_common::msg::{RemoteError, Request, Response};

use super::{misrouted, Conn};
use crate::batch::{self, BatchIo};

/// Performs one batch request.
pub(super) async fn perform(conn: &Arc<Conn>, body: Request) -> Result<Response, RemoteError> {
    let io = BatchIo {
        transport: &conn.transport,
        pool: &conn.pool,
        chunk_bytes: conn.server.chunk_bytes,
    };
    match body {
        Request::UploadBatch {
            share,
            region,
            files,
        } => batch::upload(io, conn.share(&share)?, region, files).await,
        Request::DownloadBatch {
            share,
            paths,
            region,
        } => batch::download(io, conn.share(&share)?, paths, region).await,
        other => Err(misrouted(&other)),
    }
}
