//! `Replicate`: a cluster node fetching an object from another node over the data
//! path (the other node pushes it by RDMA WRITE into this one's buffers, chunk by
//! chunk, each chunk verified), checking the whole against the manifest the request
//! names, and publishing it durably under the same path.
//!
//! Only a cluster node accepts it, only for the store share, and only from a node that
//! etcd lists as live: a session cannot make ferryd connect anywhere else.

use std::sync::Arc;

use ferry_client::cluster::{split_addr, Meta};
use ferry_client::transfer::{download_range, Assembly};
use ferry_client::{ClientError, Credentials};
use ferry_common::cluster::STORE_SHARE;
use ferry_common::msg::{ErrorKind, Hash256, HashAlgorithm, RemoteError, Response, Timestamp};
use ferry_common::seal::Encryption;

use super::Conn;

fn refuse(kind: ErrorKind, message: String) -> RemoteError {
    RemoteError { kind, message }
}

/// What a failure of the fetch looks like to the requester.
fn failed(from: &str, e: ClientError) -> RemoteError {
    match e {
        ClientError::Remote(r) => r,
        ClientError::Integrity { .. } => refuse(ErrorKind::Integrity, format!("from {from}: {e}")),
        e => refuse(ErrorKind::Io, format!("cannot replicate from {from}: {e}")),
    }
}

/// Fetches `path` of `share` from node `from` and publishes it here.
pub(super) async fn replicate(
    conn: &Arc<Conn>,
    share: &str,
    path: &str,
    from: &str,
    size: u64,
    manifest: Hash256,
) -> Result<Response, RemoteError> {
    let node = conn.server.cluster().ok_or_else(|| {
        refuse(
            ErrorKind::Unsupported,
            "this ferryd is not a cluster node".into(),
        )
    })?;
    if share != STORE_SHARE {
        return Err(refuse(
            ErrorKind::PermissionDenied,
            format!("{share}: only the cluster store share '{STORE_SHARE}' replicates"),
        ));
    }
    let local_share = conn.share(share)?;
    if local_share.read_only() {
        return Err(refuse(ErrorKind::ReadOnly, format!("{share}: read-only")));
    }
    let meta = Meta::connect(&node.endpoints)
        .await
        .map_err(|e| refuse(ErrorKind::Io, format!("cluster metadata: {e}")))?;
    let nodes = meta
        .nodes()
        .await
        .map_err(|e| refuse(ErrorKind::Io, format!("cluster metadata: {e}")))?;
    if !nodes.iter().any(|n| n.addr == from) {
        return Err(refuse(
            ErrorKind::PermissionDenied,
            format!("{from} is not a live node of this cluster"),
        ));
    }
    let (host, port) = split_addr(from)
        .ok_or_else(|| refuse(ErrorKind::Invalid, format!("{from}: not HOST:PORT")))?;
    let credentials = match conn.server.secret(STORE_SHARE) {
        Some(s) => Credentials::with_default(s.clone()),
        None => Credentials::none(),
    }
    .with_encryption(Encryption::Preferred);
    let dest = local_share.root().join(path);
    if let Some(dir) = dest.parent() {
        std::fs::create_dir_all(dir).map_err(|e| {
            refuse(
                ErrorKind::Io,
                format!("{share}/{path}: cannot create its directory: {e}"),
            )
        })?;
    }
    let fetched = async {
        let client =
            ferry_client::Client::connect_with(&host, port, node.transport, credentials).await?;
        client.authenticate(STORE_SHARE).await?;
        let asm = Assembly::open(
            &dest,
            size,
            client.welcome().chunk_bytes,
            HashAlgorithm::SUPPORTED[0],
            rand::random(),
        )
        .await?;
        let got = download_range(
            &client,
            STORE_SHARE,
            path,
            &asm,
            0,
            size,
            ferry_client::progress::no_progress(),
        )
        .await;
        client.close();
        match got {
            Ok(g) if g.manifest == manifest => {
                asm.finish(0o600, Timestamp::from_system(std::time::SystemTime::now()))
                    .await
            }
            Ok(_) => {
                asm.discard();
                Err(ClientError::Integrity {
                    what: format!(
                        "{from}: {STORE_SHARE}/{path} does not match the manifest asked for"
                    ),
                    chunk: 0,
                })
            }
            Err(e) => {
                asm.discard();
                Err(e)
            }
        }
    }
    .await;
    fetched.map_err(|e| failed(from, e))?;
    tracing::info!(from, object = path, bytes = size, "replicated");
    Ok(Response::Committed { size })
}
