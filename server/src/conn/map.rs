//! Mapped-file requests: register a file's windows for the client's one-sided READs
//! (and release them), and page through a file's chunk manifest. The session's tables
//! have granted a new mapped file its handle and checked a released one is open.

use std::sync::Arc;

use ferry_common::msg::{RemoteError, Request, Response};
use ferry_common::proto::conn::Grant;

use super::blocking::blocking;
use super::{misrouted, Conn};
use crate::map::{self, MapContext, MapError};

/// Performs one mapped-file request.
pub(super) async fn perform(
    conn: &Arc<Conn>,
    body: Request,
    grant: Grant,
) -> Result<Response, RemoteError> {
    match (body, grant) {
        (
            Request::MapOpen {
                share,
                path,
                chunk_bytes,
            },
            Grant::Map(handle),
        ) => {
            let share = conn.share(&share)?;
            let hashing = conn.hashing(&share)?;
            let slot = conn.maps.slot(handle);
            let server = conn.server.clone();
            let transport = conn.transport.clone();
            let (entry, mapped) = blocking(move || {
                let ctx = MapContext {
                    transport: &transport,
                    cache: &server.manifests,
                    budget: &server.map_budget,
                    registrations: &server.registrations,
                };
                map::open(&share, &path, chunk_bytes, &ctx, slot, hashing)
            })
            .await?;
            conn.maps.insert(entry);
            Ok(Response::Mapped(Box::new(mapped)))
        }
        (Request::MapRelease { handle }, Grant::Map(_)) => {
            let entry = conn.maps.remove(handle)?;
            // Dropping the entry revokes every registration of the file.
            blocking(move || {
                drop(entry);
                Ok::<_, MapError>(Response::Ok)
            })
            .await
        }
        (
            Request::Manifest {
                share,
                path,
                chunk_bytes,
                first_chunk,
            },
            _,
        ) => {
            let share = conn.share(&share)?;
            let hashing = conn.hashing(&share)?;
            let server = conn.server.clone();
            blocking(move || {
                map::manifest_page(
                    &share,
                    &path,
                    chunk_bytes,
                    first_chunk,
                    &server.manifests,
                    hashing,
                )
            })
            .await
        }
        (other, _) => Err(misrouted(&other).into()),
    }
}
