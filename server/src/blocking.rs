//! Running a blocking filesystem call off the async worker threads, its error turned
//! into the one the client is sent.

use ferry_common::msg::{ErrorKind, RemoteError};

/// Runs `f` on tokio's blocking pool and returns its result, its error converted to
/// the wire's [`RemoteError`]; a task that panicked fails as [`ErrorKind::Io`].
pub(crate) async fn blocking<T, E, F>(f: F) -> Result<T, RemoteError>
where
    T: Send + 'static,
    E: Into<RemoteError> + Send + 'static,
    F: FnOnce() -> Result<T, E> + Send + 'static,
{
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| RemoteError::new(ErrorKind::Io, format!("server task failed: {e}")))?
        .map_err(Into::into)
}
