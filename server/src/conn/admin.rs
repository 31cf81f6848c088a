//! Administrative requests: the server's counters, and re-reading a file to compare
//! it with its recorded manifest.

use std::sync::Arc;

use ferry_common::msg::{RemoteError, Request, Response};

use super::blocking::blocking;
use super::{misrouted, Conn};
use crate::verify;

/// Performs one administrative request.
pub(super) async fn perform(conn: &Arc<Conn>, body: Request) -> Result<Response, RemoteError> {
    match body {
        Request::Stats => Ok(Response::Stats(conn.server.stats())),
        Request::Counters => Ok(Response::Counters(conn.server.traffic.counters())),
        Request::Verify { share, path } => {
            let share = conn.share(&share)?;
            blocking(move || verify::verify(&share, &path)).await
        }
        Request::Replicate {
            share,
            path,
            from,
            size,
            manifest,
        } => super::replicate::replicate(conn, &share, &path, &from, size, manifest).await,
        other => Err(misrouted(&other).into()),
    }
}
