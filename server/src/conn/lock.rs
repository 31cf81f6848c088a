//! Lock requests (the `locks` capability): `fcntl`/`flock` locks that every session of
//! the server sees, kept in the server's [`ferry_common::locks::LockTable`] under this
//! connection's session id. A lock request resolves its path (symlinks followed, within
//! the share) to the file's `(dev, ino)`, so a rename does not escape a lock.
//!
//! A request never waits: a conflict is answered at once with the lock in the way,
//! and a client that must wait (`F_SETLKW`) asks again. The connection's locks all go
//! when it ends ([`super::run`]).

use std::os::unix::fs::MetadataExt;
use std::sync::Arc;

use ferry_common::locks::{LockError, LockFile, LockHeld, LockOwner, LockTable};
use ferry_common::msg::{ErrorKind, RemoteError, Request, Response};

use super::blocking::blocking;
use super::{misrouted, Conn};
use crate::fsops::FsError;

/// Performs one lock request.
pub(super) async fn perform(conn: &Arc<Conn>, body: Request) -> Result<Response, RemoteError> {
    match body {
        Request::Lock {
            share,
            path,
            owner,
            kind,
            start,
            end,
            pid,
        } => {
            answer(
                conn,
                &share,
                path,
                owner,
                |locks, file, owner| match locks.set(file, owner, kind, (start, end), pid) {
                    Ok(()) => Ok(None),
                    Err(LockError::Conflict(held)) => Ok(Some(held)),
                    Err(e @ LockError::TooMany) => {
                        Err(RemoteError::new(ErrorKind::Busy, e.to_string()))
                    }
                    Err(e @ LockError::BadRange) => {
                        Err(RemoteError::new(ErrorKind::Invalid, e.to_string()))
                    }
                },
            )
            .await
        }
        Request::LockTest {
            share,
            path,
            owner,
            kind,
            start,
            end,
        } => {
            answer(conn, &share, path, owner, |locks, file, owner| {
                Ok(locks.test(file, owner, kind, start, end))
            })
            .await
        }
        Request::LockRelease { share, file, owner } => {
            // The share must be one the session may use, as for every request.
            conn.share(&share)?;
            let owner = LockOwner {
                session: conn.lock_session,
                owner,
            };
            conn.server.locks().release_owner(file, owner);
            Ok(Response::Ok)
        }
        other => Err(misrouted(&other).into()),
    }
}

/// Answers a `Lock` or `LockTest` on the file `path` of `share` names, for `owner` of
/// this connection's session: `decide` runs under the server's lock table and returns
/// the lock in the way, if any.
async fn answer(
    conn: &Arc<Conn>,
    share: &str,
    path: String,
    owner: u64,
    decide: impl FnOnce(&mut LockTable, LockFile, LockOwner) -> Result<Option<LockHeld>, RemoteError>,
) -> Result<Response, RemoteError> {
    let file = identify(conn, share, path).await?;
    let owner = LockOwner {
        session: conn.lock_session,
        owner,
    };
    let conflict = decide(&mut conn.server.locks(), file, owner)?;
    Ok(Response::Lock { file, conflict })
}

/// The identity of the file `path` of `share` names (symlinks followed).
async fn identify(conn: &Arc<Conn>, share: &str, path: String) -> Result<LockFile, RemoteError> {
    let share = conn.share(share)?;
    blocking(move || -> Result<LockFile, FsError> {
        let resolved = share.resolve(&path, true)?;
        let meta = std::fs::metadata(&resolved).map_err(|source| FsError::Stat {
            path: share.display(&path),
            source,
        })?;
        Ok(LockFile {
            dev: meta.dev(),
            ino: meta.ino(),
        })
    })
    .await
}
