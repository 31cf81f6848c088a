//! Running a blocking filesystem call off the async worker threads, its error turned
//! into the one the client is sent.

use ferry_common::msg::RemoteError;

use super::ConnError;

/// Runs `f` on tokio's blocking pool and returns its result, its error converted to
/// the wire's [`RemoteError`]; a task that panicked fails as [`ConnError::Task`].
pub(crate) async fn blocking<T, E, F>(f: F) -> Result<T, RemoteError>
where
    T: Send + 'static,
    E: Into<RemoteError> + Send + 'static,
    F: FnOnce() -> Result<T, E> + Send + 'static,
{
    tokio::task::spawn_blocking(f)
        .await
        .map_err(ConnError::Task)?
        .map_err(Into::into)
}
