//! `Replicate`: a cluster node fetching an object from another node over the data
//! path (the other node pushes it by RDMA WRITE into this one's buffers, chunk by
//! chunk, each chunk verified), checking the whole against the manifest the request
//! names, and publishing it durably under the same path.
//!
//! Only a cluster node accepts it, only for the store share, and only from a node that
//! etcd lists as live: a session cannot make ferryd connect anywhere else.
//!
//! Confinement (invariants, in the order they are checked):
//! - the path is exactly a store object's path ([`ObjectPath::parse`]: `SHARE/FAN/ID.N`,
//!   nothing else, so no `..`, no absolute path, no other spelling) and the existing
//!   part of it resolves inside the store share by the share's resolver (a symlinked
//!   directory that leads out is refused), all before anything is fetched or created;
//! - the object is fetched into the share's private incoming directory (under the
//!   state directory, which no request can name), never beside its final name;
//! - only once the whole object verified against the manifest are its directories made
//!   and its final name resolved, both by the share's resolver, and the verified file
//!   renamed there. A failed fetch names nothing in the share.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use ferry_client::transfer::{download_range, Assembly, Part};
use ferry_client::{ClientError, Credentials};
use ferry_cluster::health::{self, HealthPolicy};
use ferry_cluster::model::{NodeInfo, ObjectPath, STORE_SHARE};
use ferry_cluster::split_addr;
use ferry_common::msg::{
    ErrorKind, Hash256, HashAlgorithm, NewDir, RemoteError, Response, Timestamp,
};

use super::blocking::blocking;
use super::Conn;
use crate::dirs::make_dirs;
use crate::share::{Share, ShareError};

/// Mode of the store's object directories (as the copy drivers make them).
const OBJECT_DIR_MODE: u32 = 0o700;

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

/// What the request asks for, admitted.
struct Wanted {
    path: String,
    dirs: [String; 2],
    size: u64,
    manifest: Hash256,
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
    let wanted = admit(&local_share, path, size, manifest)?;
    let nodes = live_nodes(conn).await?;
    if !nodes.iter().any(|n| n.addr == from) {
        return Err(refuse(
            ErrorKind::PermissionDenied,
            format!("{from} is not a live node of this cluster"),
        ));
    }
    let credentials = match conn.server.secret(STORE_SHARE) {
        Some(s) => Credentials::with_default(s.clone()),
        None => Credentials::none(),
    }
    .with_encryption(conn.server.policy(STORE_SHARE));
    let incoming = {
        let s = local_share.clone();
        blocking(move || s.incoming_dir()).await?
    };
    let staged = fetch(node.transport, credentials, from, &wanted, incoming).await?;
    let s = local_share.clone();
    blocking(move || publish(&s, &wanted, &staged)).await?;
    tracing::info!(from, object = path, bytes = size, "replicated");
    Ok(Response::Committed { size })
}

/// Admits the request before anything is fetched or created: `path` must be a store
/// object's path, on a writable share, and whatever of it exists must resolve inside
/// the share (so a symlinked directory that leads out is refused now).
fn admit(share: &Share, path: &str, size: u64, manifest: Hash256) -> Result<Wanted, RemoteError> {
    share.check_writable()?;
    let object = ObjectPath::parse(path).ok_or_else(|| {
        refuse(
            ErrorKind::InvalidPath,
            format!(
                "{}: not a store object's path (SHARE/FAN/ID.INDEX)",
                share.display(path)
            ),
        )
    })?;
    let dirs = object.dirs();
    for dir in &dirs {
        match share.resolve(dir, true) {
            Ok(_) => {}
            Err(ShareError::Follow { source, .. })
                if source.kind() == std::io::ErrorKind::NotFound => {}
            Err(ShareError::ResolveDir { source, .. })
                if source.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(e.into()),
        }
    }
    Ok(Wanted {
        path: path.to_owned(),
        dirs,
        size,
        manifest,
    })
}

/// Fetches the object from `from` into `incoming` and checks it against the manifest
/// asked for; returns the verified, durable file (not yet under its final name).
async fn fetch(
    transport: ferry_common::transport::TransportChoice,
    credentials: Credentials,
    from: &str,
    wanted: &Wanted,
    incoming: PathBuf,
) -> Result<PathBuf, RemoteError> {
    let (host, port) = split_addr(from)
        .ok_or_else(|| refuse(ErrorKind::Invalid, format!("{from}: not HOST:PORT")))?;
    let path = wanted.path.as_str();
    // Named after the object, so a fetch cut short is resumed by the next one (the
    // staging journal is tagged with the manifest wanted).
    let staged = incoming.join(path.replace('/', "_"));
    // The source node is held to the progress deadline, as every stripe transfer is:
    // a hung source fails the fetch in seconds, and the repair moves on.
    let policy = HealthPolicy::from_env();
    let credentials = credentials.with_liveness(policy.node_liveness());
    let into = &staged;
    let fetched = health::watch(from, policy.progress_deadline, |progress| async move {
        let client =
            ferry_client::Client::connect_with(&host, port, transport, credentials).await?;
        progress.attach(&client);
        client.authenticate(STORE_SHARE).await?;
        let asm = Assembly::open(
            into,
            wanted.size,
            client.welcome().chunk_bytes,
            HashAlgorithm::SUPPORTED[0],
            wanted.manifest,
        )
        .await?;
        let got = download_range(
            &client,
            STORE_SHARE,
            path,
            Part::Assembly(&asm),
            0,
            wanted.size,
            progress.wrap(ferry_client::progress::no_progress()),
        )
        .await;
        client.close();
        match got {
            Ok(g) if g.manifest == wanted.manifest => {
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
            Err(e) => Err(e),
        }
    })
    .await;
    fetched.map_err(|e| failed(from, e))?;
    Ok(staged)
}

/// Makes the object's directories and renames the verified `staged` file to its final
/// name, both resolved by the share's resolver. Blocking.
fn publish(share: &Share, wanted: &Wanted, staged: &Path) -> Result<(), RemoteError> {
    let dirs: Vec<NewDir> = wanted
        .dirs
        .iter()
        .map(|d| NewDir {
            path: d.clone(),
            mode: OBJECT_DIR_MODE,
        })
        .collect();
    let outcome = make_dirs(share, &dirs)
        .into_iter()
        .collect::<Result<Vec<()>, _>>()
        .map_err(RemoteError::from)
        .and_then(|_| {
            share
                .resolve_for_write(&wanted.path)
                .map_err(RemoteError::from)
        })
        .and_then(|dest| {
            std::fs::rename(staged, &dest).map_err(|e| {
                refuse(
                    ErrorKind::Io,
                    format!("{}: cannot publish: {e}", share.display(&wanted.path)),
                )
            })
        });
    if outcome.is_err() {
        let _ = std::fs::remove_file(staged);
    }
    outcome
}

/// The live nodes, read through the process's one etcd connection (reset when etcd
/// fails, so the next request connects afresh).
async fn live_nodes(conn: &Arc<Conn>) -> Result<Vec<NodeInfo>, RemoteError> {
    let unsupported = || {
        refuse(
            ErrorKind::Unsupported,
            "this ferryd is not a cluster node".into(),
        )
    };
    let link = conn.server.cluster_etcd().ok_or_else(unsupported)?;
    let read = async { link.get().await?.nodes().await };
    match read.await {
        Ok(nodes) => Ok(nodes),
        Err(e) => {
            link.reset().await;
            Err(refuse(ErrorKind::Io, format!("cluster metadata: {e}")))
        }
    }
}
