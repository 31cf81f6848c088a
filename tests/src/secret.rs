//! The secret every test server guards its shares with, and how test clients prove it.
//!
//! Test servers get it through `$FERRYD_SECRET` and test clients through
//! `$FERRY_SECRET` (an environment value needs no file that each user under test must
//! own); the tests of secret files and of refused peers make their own.

use ferry_client::client::Credentials;
use ferry_client::Client;
use ferry_common::auth::Secret;
use ferry_common::msg::ErrorKind;
use ferry_common::transport::TransportChoice;

/// The secret of every share of a test server.
pub const TEST_SECRET: &str = "ferry-test-secret-4f1c9a2b7e";

/// [`TEST_SECRET`] as a [`Secret`].
pub fn test_secret() -> Secret {
    Secret::from_bytes(TEST_SECRET.as_bytes(), "the test secret").expect("a valid secret")
}

/// Credentials that prove [`TEST_SECRET`] for every share.
pub fn credentials() -> Credentials {
    Credentials::with_default(test_secret())
}

/// An in-process client of a test server at `host:port`, proving [`TEST_SECRET`] for
/// every share it uses. It proves [`crate::DEFAULT_SHARE`]'s at once (when the server
/// has that share), so server-wide requests such as `Stats` are allowed from the start.
pub async fn connect_to(
    host: &str,
    port: u16,
    choice: TransportChoice,
) -> Result<Client, ferry_client::ClientError> {
    let client = Client::connect_with(host, port, choice, credentials()).await?;
    match client.authenticate(crate::DEFAULT_SHARE).await {
        Err(e) if e.remote_kind() != Some(ErrorKind::NoSuchShare) => Err(e),
        _ => Ok(client),
    }
}

/// Writes [`TEST_SECRET`] to `dir/ferry.secret` with mode 0600 (for an in-process
/// server's `ShareConfig::secret_file`) and returns its path.
pub fn write_secret_file(dir: &std::path::Path) -> std::path::PathBuf {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let path = dir.join("ferry.secret");
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&path)
        .unwrap_or_else(|e| panic!("cannot create {}: {e}", path.display()));
    f.write_all(TEST_SECRET.as_bytes())
        .unwrap_or_else(|e| panic!("cannot write {}: {e}", path.display()));
    path
}
