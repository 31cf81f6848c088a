//! The lock requests (the `locks` capability): `fcntl` and `flock` locks the server
//! holds for every client of a share. Thin, as [`crate::files`]: each call sends one
//! request and checks the shape of its answer.

use ferry_common::locks::{LockFile, LockHeld, LockKind};
use ferry_common::msg::{Request, Response};
use ferry_common::proto::caps::LOCKS;
use ferry_common::proto::ProtoError;

use crate::client::{expect_ok, unexpected};
use crate::{Client, ClientError};

/// A lock request's range: first byte and last byte, inclusive.
pub type LockRange = (u64, u64);

/// The answer to [`Client::lock`] and [`Client::lock_test`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LockAnswer {
    /// The file's identity on the server, for [`Client::lock_release`].
    pub file: LockFile,
    /// The lock in the way (nothing changed), or `None`: done (for a test: free).
    pub conflict: Option<LockHeld>,
}

impl Client {
    /// Whether the session negotiated the `locks` capability, without which the
    /// requests of this module are refused unsent.
    pub fn has_locks(&self) -> bool {
        self.negotiated().is_some_and(|n| n.locks)
    }

    async fn call_locks(&self, req: Request) -> Result<Response, ClientError> {
        if !self.has_locks() {
            return Err(ClientError::Protocol(ProtoError::Transfer(format!(
                "the server at {} does not hold locks (no '{LOCKS}' capability): it is an \
                 older ferryd",
                self.addr()
            ))));
        }
        self.call(req).await
    }

    /// Takes, changes or drops `owner`'s lock of `kind` on `range` of `path` (see
    /// [`Request::Lock`]); never waits.
    pub async fn lock(
        &self,
        share: &str,
        path: &str,
        owner: u64,
        kind: LockKind,
        (start, end): LockRange,
        pid: u32,
    ) -> Result<LockAnswer, ClientError> {
        let req = Request::Lock {
            share: share.into(),
            path: path.into(),
            owner,
            kind,
            start,
            end,
            pid,
        };
        expect_lock(self.call_locks(req).await?)
    }

    /// The lock that would stop `owner` taking `kind` on `range` of `path`, if any.
    pub async fn lock_test(
        &self,
        share: &str,
        path: &str,
        owner: u64,
        kind: LockKind,
        (start, end): LockRange,
    ) -> Result<LockAnswer, ClientError> {
        let req = Request::LockTest {
            share: share.into(),
            path: path.into(),
            owner,
            kind,
            start,
            end,
        };
        expect_lock(self.call_locks(req).await?)
    }

    /// Drops every lock of `owner` on `file`.
    pub async fn lock_release(
        &self,
        share: &str,
        file: LockFile,
        owner: u64,
    ) -> Result<(), ClientError> {
        let req = Request::LockRelease {
            share: share.into(),
            file,
            owner,
        };
        expect_ok(self.call_locks(req).await?)
    }
}

fn expect_lock(resp: Response) -> Result<LockAnswer, ClientError> {
    match resp {
        Response::Lock { file, conflict } => Ok(LockAnswer { file, conflict }),
        other => Err(unexpected(other)),
    }
}
