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
        #[cfg(feature = "cluster")]
        Request::Replicate {
            share,
            path,
            from,
            size,
            manifest,
        } => super::replicate::replicate(conn, &share, &path, &from, size, manifest).await,
        #[cfg(not(feature = "cluster"))]
        Request::Replicate { .. } => Err(RemoteError {
            kind: ferry_common::msg::ErrorKind::Unsupported,
            message: "this ferryd was built without cluster support".into(),
        }),
        other => Err(misrouted(&other).into()),
    }
}
