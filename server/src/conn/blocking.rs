//! Running a blocking filesystem call off the async worker threads, its error turned
//! into the one the client is sent.

use ferry_common::msg::RemoteError;

use super::ConnError;

/// Runs `f` on tokio's blocking pool, acting as the request's caller if it has one
/// ([`crate::owners::spawn_blocking`]), and returns its result, its error converted to
/// the wire's [`RemoteError`]; a task that panicked fails as [`ConnError::Task`], one
/// that could not act as its caller as [`ConnError::Act`].
pub(crate) async fn blocking<T, E, F>(f: F) -> Result<T, RemoteError>
where
    T: Send + 'static,
    E: Into<RemoteError> + Send + 'static,
    F: FnOnce() -> Result<T, E> + Send + 'static,
{
    crate::owners::spawn_blocking(f)
        .await
        .map_err(ConnError::Task)?
        .map_err(ConnError::Act)?
        .map_err(Into::into)
}
