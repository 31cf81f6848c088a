//! Connecting to the target of a backup command: a node's `HOST[:PORT]:SHARE/PREFIX`
//! or a cluster's `cluster://ETCD_HOST[:PORT]/SHARE/PREFIX`.

use std::path::Path;

use ferry_client::error::ClientError;
use ferry_client::location::{self, Location};
use ferry_client::{Client, Credentials};
use ferry_cluster::{copy::ClusterPath, Cluster, EtcdArgs};
use ferry_common::msg::HashAlgorithm;
use ferry_common::seal::Encryption;
use ferry_common::transport::TransportChoice;

/// How a subcommand connects: `--transport`, `--hash` and `--encryption`.
#[derive(Debug, Clone, Copy)]
pub struct Connect {
    /// The transport asked for.
    pub transport: TransportChoice,
    /// The one hash algorithm to offer, if one was named.
    pub hash: Option<HashAlgorithm>,
    /// The encryption policy.
    pub encryption: Encryption,
}

impl Connect {
    /// The transport, and the credentials from `secret_file` (or the environment)
    /// with this hash and encryption policy.
    fn credentials(
        self,
        secret_file: Option<&Path>,
    ) -> Result<(TransportChoice, Credentials), ClientError> {
        let credentials = Credentials::from_file_or_env(secret_file)?
            .with_hash(self.hash)
            .with_encryption(self.encryption);
        Ok((self.transport, credentials))
    }
}

/// Connects to `target` (`connect`: transport, the one hash to offer if given,
/// encryption) and authenticates; returns the client, the share and the path. A
/// target without a path is a usage error saying `wanted` (what the option takes,
/// e.g. `the destination must be HOST[:PORT]:SHARE/PREFIX`).
pub async fn open(
    target: &str,
    wanted: &str,
    connect: Connect,
    secret_file: Option<&Path>,
) -> Result<(Client, String, String), ClientError> {
    let remote = match location::parse(target, ferry_common::DEFAULT_PORT)? {
        Location::Remote(r) if !r.path.is_empty() => r,
        _ => return Err(ClientError::Usage(format!("{target}: {wanted}"))),
    };
    let (transport, credentials) = connect.credentials(secret_file)?;
    let client = Client::connect_with(&remote.host, remote.port, transport, credentials).await?;
    client.authenticate(&remote.share).await?;
    Ok((client, remote.share, remote.path))
}

/// Connects to the cluster a `cluster://ETCD/SHARE/PATH` `target` names (etcd's
/// settings from `etcd`, the nodes' as [`open`]'s); returns it and the parsed target.
/// A target that is not a `cluster://` URL is a usage error.
pub async fn open_cluster(
    target: &str,
    etcd: &EtcdArgs,
    connect: Connect,
    secret_file: Option<&Path>,
) -> Result<(Cluster, ClusterPath), ClientError> {
    let parsed = ferry_cluster::copy::parse(target)
        .ok_or_else(|| ClientError::Usage(format!("{target}: not a cluster:// URL")))??;
    let (transport, credentials) = connect.credentials(secret_file)?;
    let etcd = etcd.resolve(Some(vec![parsed.etcd.clone()]))?;
    let cluster = Cluster::connect(&etcd, transport, credentials).await?;
    Ok((cluster, parsed))
}

/// True if `target` names a cluster (`cluster://...`).
pub fn is_cluster(target: &str) -> bool {
    target.starts_with("cluster://")
}
