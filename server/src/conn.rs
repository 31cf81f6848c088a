//! The per-connection driver: feeds received messages into the sans-IO
//! [`ServerSession`], runs each request on its own task, and sends what the session
//! queues. It makes no protocol decisions of its own.
//!
//! Teardown invariant: when the connection ends, the driver closes the transport (so
//! every outstanding one-sided operation fails promptly), waits for every request task
//! to finish, then drops the open transfers (an unfinished upload's scratch file is
//! removed, its resumable partial and journal are kept for a later upload to resume),
//! and the open mapped files, which revokes their registrations.
//!
//! Bound: at most [`MAX_INFLIGHT_REQUESTS`] request tasks live at once, counted from
//! dispatch until their answer has been handed to the transport (which queues at most
//! `MAX_QUEUED_CTRL_BYTES` and then makes senders wait), and answers are sent by one
//! task at a time. So a peer that does not read its answers stops being read from: the
//! driver waits for a request slot before it takes the next message, and what the
//! connection holds stays bounded.
//!
//! Counts: the connection, its open transfers and its registrations are counted in the
//! server's gauges until they are dropped, so the counts [`crate::Server::stats`]
//! reports fall back once every connection is gone.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use ferry_common::codec;
use ferry_common::msg::{ErrorKind, Message, RemoteError, Request, Response};
use ferry_common::proto::server::{ServerEvent, ServerParams, ServerSession};
use ferry_common::proto::MAX_INFLIGHT_REQUESTS;
use ferry_common::transport::SharedTransport;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::task::JoinSet;

use crate::batch::{self, BatchIo};
use crate::error::remote;
use crate::gauge::Held;
use crate::map::{self, MapContext, MapTable};
use crate::pool::Pool;
use crate::share::Share;
use crate::transfer::{BaseFile, Download, Transfer, Upload};
use crate::{du, fsops, links, remove, verify};
use crate::{Server, SOFTWARE};

/// Most transfers one connection may have open at once.
pub const MAX_OPEN_TRANSFERS: usize = 1024;

struct Conn {
    server: Arc<Server>,
    transport: SharedTransport,
    peer: String,
    session: Mutex<ServerSession>,
    transfers: Mutex<HashMap<u64, Arc<OpenTransfer>>>,
    next_transfer: AtomicU64,
    pool: Arc<Pool>,
    maps: MapTable,
    /// One permit per live request task ([`MAX_INFLIGHT_REQUESTS`]), held until its
    /// answer is handed to the transport.
    request_slots: Arc<Semaphore>,
    /// Held while sending, so answers go out one task at a time and an answer waits
    /// in the session (once) rather than in many senders' hands.
    sending: tokio::sync::Mutex<()>,
}

/// A transfer in a connection's table, counted in the server's open transfers until its
/// last reference (the table's or a request task's) is dropped.
struct OpenTransfer {
    // Field order is drop order: an upload's hidden file is let go of (its lock
    // released, a scratch file removed) before the count falls.
    transfer: Transfer,
    _counted: Held,
}

/// Serves one connection, accepted at `accepted` and counted by `live`, to the end.
/// The session's handshake must finish within `HANDSHAKE_TIMEOUT` of `accepted`.
pub(crate) async fn run(
    server: Arc<Server>,
    transport: SharedTransport,
    live: Held,
    accepted: Instant,
) {
    // Bound first, dropped last: the connection is counted until everything it held
    // (pool, transfers, mapped files, transport) is gone.
    let _live = live;
    let peer = transport.peer();
    let params = ServerParams {
        software: SOFTWARE.into(),
        chunk_bytes: server.chunk_bytes,
        access: server.access.clone(),
    };
    let pool = Pool::new(
        transport.clone(),
        server.chunk_bytes as usize,
        server.queue_depth,
        server.registrations.clone(),
    );
    let conn = Arc::new(Conn {
        session: Mutex::new(ServerSession::new(
            accepted,
            params,
            ferry_common::auth::fresh_nonce(),
        )),
        server,
        transport,
        peer,
        transfers: Mutex::new(HashMap::new()),
        next_transfer: AtomicU64::new(1),
        pool,
        maps: MapTable::new(),
        request_slots: Arc::new(Semaphore::new(MAX_INFLIGHT_REQUESTS as usize)),
        sending: tokio::sync::Mutex::new(()),
    });
    tracing::info!(peer = %conn.peer, transport = conn.transport.kind().as_str(), "connection opened");
    let mut tasks = JoinSet::new();
    let reason = conn.drive(&mut tasks).await;
    conn.transport.close();
    while tasks.join_next().await.is_some() {}
    let open = std::mem::take(&mut *conn.transfers());
    if !open.is_empty() {
        tracing::info!(peer = %conn.peer, "dropping {} unfinished transfers", open.len());
    }
    drop(open);
    let maps = conn.maps.take_all();
    if !maps.is_empty() {
        tracing::info!(peer = %conn.peer, "releasing {} mapped files", maps.len());
    }
    // Deregistering large mappings can take a while on RDMA: off the async threads.
    let _ = blocking(move || {
        drop(maps);
        Ok(())
    })
    .await;
    tracing::info!(peer = %conn.peer, "connection closed: {reason}");
}

impl Conn {
    fn session(&self) -> std::sync::MutexGuard<'_, ServerSession> {
        // Session methods do not panic on peer input; poisoning would mean a bug, and
        // the state is still the best we have.
        self.session.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn transfers(&self) -> std::sync::MutexGuard<'_, HashMap<u64, Arc<OpenTransfer>>> {
        self.transfers.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Runs until the connection ends; returns why.
    async fn drive(self: &Arc<Self>, tasks: &mut JoinSet<()>) -> String {
        let mut stop = self.server.stop_signal();
        // The slot the next request will run in; taken before the next message is
        // read, so no message is read while every slot is busy.
        let mut slot = None;
        loop {
            if slot.is_none() {
                slot = tokio::select! {
                    permit = self.request_slots.clone().acquire_owned() => permit.ok(),
                    _ = stop.wait_for(|stopping| *stopping) => return "server shutting down".into(),
                };
            }
            let deadline = self.session().poll_timeout();
            let sleep = async {
                match deadline {
                    Some(d) => tokio::time::sleep_until(d.into()).await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                received = self.transport.recv() => match received {
                    Ok(Some(bytes)) => match codec::decode(&bytes) {
                        Ok(msg) => {
                            let _ = self.session().handle_message(Instant::now(), msg);
                        }
                        Err(e) => {
                            tracing::warn!(peer = %self.peer, "malformed control message: {e}");
                            return format!("malformed control message: {e}");
                        }
                    },
                    Ok(None) => return "peer closed the connection".into(),
                    Err(e) => return format!("transport error: {e}"),
                },
                () = sleep => self.session().handle_timeout(Instant::now()),
                _ = stop.wait_for(|stopping| *stopping) => return "server shutting down".into(),
            }
            // Sending waits while the transport's queue is full (a peer that does not
            // read): no more requests are taken from it meanwhile, but shutdown is.
            let pumped = tokio::select! {
                closed = self.pump(tasks, &mut slot) => closed,
                _ = stop.wait_for(|stopping| *stopping) => return "server shutting down".into(),
            };
            if let Some(reason) = pumped {
                return reason;
            }
            while tasks.try_join_next().is_some() {}
        }
    }

    /// Acts on every queued session event and sends what the session queued. A request
    /// runs in `slot` (or, should one message ever yield two requests, in a slot waited
    /// for here).
    async fn pump(
        self: &Arc<Self>,
        tasks: &mut JoinSet<()>,
        slot: &mut Option<OwnedSemaphorePermit>,
    ) -> Option<String> {
        let mut closed = None;
        loop {
            let event = self.session().poll_event();
            match event {
                None => break,
                Some(ServerEvent::Ready { software }) => {
                    tracing::debug!(peer = %self.peer, client = %software, "session ready");
                }
                Some(ServerEvent::Authenticated { share }) => {
                    tracing::info!(peer = %self.peer, share = %share.escape_debug(), "authenticated");
                }
                Some(ServerEvent::Denied { share, reason }) => {
                    tracing::warn!(
                        peer = %self.peer,
                        share = %share.escape_debug(),
                        "refused peer: {reason}"
                    );
                }
                Some(ServerEvent::Request { id, body }) => {
                    let permit = match slot.take() {
                        Some(p) => Some(p),
                        None => self.request_slots.clone().acquire_owned().await.ok(),
                    };
                    let conn = self.clone();
                    tasks.spawn(async move {
                        let response = match conn.dispatch(body).await {
                            Ok(r) => r,
                            Err(e) => Response::Error(e),
                        };
                        conn.session().respond(id, response);
                        conn.flush().await;
                        drop(permit);
                    });
                }
                Some(ServerEvent::Closed(reason)) => {
                    tracing::warn!(peer = %self.peer, "session closed: {reason}");
                    closed = Some(reason.to_string());
                }
            }
        }
        self.flush().await;
        closed
    }

    /// Sends every message the session has queued (waiting for the sender before,
    /// so a message queued now is sent before this returns).
    async fn flush(&self) {
        let _sending = self.sending.lock().await;
        let out: Vec<_> = {
            let mut s = self.session();
            std::iter::from_fn(|| s.poll_transmit()).collect()
        };
        for msg in out {
            match codec::encode(&msg) {
                Ok(bytes) => {
                    if self.transport.send(bytes).await.is_err() {
                        return;
                    }
                }
                Err(e) => tracing::error!(peer = %self.peer, "cannot encode a response: {e}"),
            }
        }
    }

    fn share(&self, name: &str) -> Result<Arc<Share>, RemoteError> {
        self.server.share(name).cloned().ok_or_else(|| {
            remote(
                ErrorKind::NoSuchShare,
                format!("no such share '{}'", name.escape_debug()),
            )
        })
    }

    fn open_transfer(&self, t: Transfer) -> Result<u64, RemoteError> {
        let mut map = self.transfers();
        if map.len() >= MAX_OPEN_TRANSFERS {
            return Err(remote(
                ErrorKind::Protocol,
                format!("more than {MAX_OPEN_TRANSFERS} transfers open on one connection"),
            ));
        }
        let id = self.next_transfer.fetch_add(1, Ordering::Relaxed);
        let open = OpenTransfer {
            transfer: t,
            _counted: self.server.transfers.hold(1),
        };
        map.insert(id, Arc::new(open));
        Ok(id)
    }

    fn batch_io(&self) -> BatchIo<'_> {
        BatchIo {
            transport: &self.transport,
            pool: &self.pool,
            chunk_bytes: self.server.chunk_bytes,
        }
    }

    fn transfer(&self, id: u64) -> Result<Arc<OpenTransfer>, RemoteError> {
        self.transfers()
            .get(&id)
            .cloned()
            .ok_or_else(|| remote(ErrorKind::Protocol, format!("no open transfer {id}")))
    }

    async fn dispatch(self: &Arc<Self>, body: Request) -> Result<Response, RemoteError> {
        self.server.count_request();
        let chunk_bytes = self.server.chunk_bytes;
        match body {
            Request::Stat {
                share,
                path,
                follow,
            } => {
                let share = self.share(&share)?;
                blocking(move || fsops::stat(&share, &path, follow)).await
            }
            Request::ListDir {
                share,
                path,
                cursor,
            } => {
                let share = self.share(&share)?;
                blocking(move || fsops::list_dir(&share, &path, cursor)).await
            }
            Request::Mkdir {
                share,
                path,
                mode,
                exist_ok,
            } => {
                let share = self.share(&share)?;
                blocking(move || fsops::mkdir(&share, &path, mode, exist_ok)).await
            }
            Request::Symlink {
                share,
                path,
                target,
            } => {
                let share = self.share(&share)?;
                blocking(move || fsops::make_symlink(&share, &path, &target)).await
            }
            Request::SetAttr {
                share,
                path,
                mode,
                mtime,
            } => {
                let share = self.share(&share)?;
                blocking(move || fsops::set_attr(&share, &path, mode, mtime)).await
            }
            Request::UploadOpen {
                share,
                path,
                size,
                mode,
                mtime,
            } => {
                let share = self.share(&share)?;
                let up = blocking(move || {
                    Upload::open(&share, &path, size, mode, mtime, chunk_bytes, None)
                })
                .await?;
                let transfer = self.open_transfer(Transfer::Upload(Box::new(up)))?;
                Ok(Response::UploadOpened { transfer })
            }
            Request::UploadOpenBase {
                share,
                path,
                size,
                mode,
                mtime,
                base,
            } => {
                let share = self.share(&share)?;
                let server = self.server.clone();
                let up = blocking(move || {
                    share.check_writable()?;
                    let base = BaseFile::open(&share, &base, chunk_bytes, &server.manifests)?;
                    Upload::open(&share, &path, size, mode, mtime, chunk_bytes, Some(base))
                })
                .await?;
                let transfer = self.open_transfer(Transfer::Upload(Box::new(up)))?;
                Ok(Response::UploadOpened { transfer })
            }
            Request::UploadWindow {
                transfer,
                offset,
                region,
                hashes,
            } => match &self.transfer(transfer)?.transfer {
                Transfer::Upload(up) => {
                    up.pull_window(&self.transport, &self.pool, offset, region, hashes)
                        .await
                }
                Transfer::Download(_) => Err(not_a(transfer, "an upload")),
            },
            Request::UploadCommit { transfer, manifest } => {
                let t = self.transfer(transfer)?;
                if !matches!(&t.transfer, Transfer::Upload(_)) {
                    return Err(not_a(transfer, "an upload"));
                }
                let response = blocking(move || match &t.transfer {
                    Transfer::Upload(up) => up.commit(&manifest),
                    Transfer::Download(_) => Err(not_a(transfer, "an upload")),
                })
                .await?;
                self.transfers().remove(&transfer);
                Ok(response)
            }
            Request::DownloadOpen { share, path } => {
                let share = self.share(&share)?;
                let down = blocking(move || Download::open(&share, &path, chunk_bytes)).await?;
                let attr = down.attr().clone();
                let transfer = self.open_transfer(Transfer::Download(down))?;
                Ok(Response::DownloadOpened { transfer, attr })
            }
            Request::DownloadWindow {
                transfer,
                offset,
                region,
            } => match &self.transfer(transfer)?.transfer {
                Transfer::Download(down) => {
                    down.push_window(&self.transport, &self.pool, offset, region)
                        .await
                }
                Transfer::Upload(_) => Err(not_a(transfer, "a download")),
            },
            Request::Close { transfer } => {
                let t = self.transfers().remove(&transfer).ok_or_else(|| {
                    remote(ErrorKind::Protocol, format!("no open transfer {transfer}"))
                })?;
                blocking(move || match &t.transfer {
                    Transfer::Download(down) => down.close(),
                    // The client gave up on the upload: nothing of it is kept.
                    Transfer::Upload(up) => {
                        up.discard();
                        Ok(Response::Ok)
                    }
                })
                .await
            }
            Request::MapOpen {
                share,
                path,
                chunk_bytes,
            } => {
                let share = self.share(&share)?;
                // Limits first, so a refused open costs no hashing.
                let slot = self.maps.reserve_slot()?;
                let server = self.server.clone();
                let transport = self.transport.clone();
                let (entry, mapped) = blocking(move || {
                    let ctx = MapContext {
                        transport: &transport,
                        cache: &server.manifests,
                        budget: &server.map_budget,
                        registrations: &server.registrations,
                    };
                    map::open(&share, &path, chunk_bytes, &ctx, slot)
                })
                .await?;
                self.maps.insert(entry);
                Ok(Response::Mapped(Box::new(mapped)))
            }
            Request::MapRelease { handle } => {
                let entry = self.maps.remove(handle)?;
                // Dropping the entry revokes every registration of the file.
                blocking(move || {
                    drop(entry);
                    Ok(Response::Ok)
                })
                .await
            }
            Request::StatFs { share } => {
                let share = self.share(&share)?;
                blocking(move || fsops::statfs(&share)).await
            }
            Request::Stats => Ok(Response::Stats(self.server.stats())),
            Request::Link { share, from, to } => {
                let share = self.share(&share)?;
                blocking(move || links::link(&share, &from, &to)).await
            }
            Request::LinkBatch { share, links } => {
                let share = self.share(&share)?;
                let n = links.len();
                let response = blocking(move || Ok(links::link_batch(&share, &links))).await;
                tracing::debug!(peer = %self.peer, links = n, "link batch");
                response
            }
            Request::Rename { share, from, to } => {
                let share = self.share(&share)?;
                blocking(move || fsops::rename(&share, &from, &to)).await
            }
            Request::Manifest {
                share,
                path,
                chunk_bytes,
                first_chunk,
            } => {
                let share = self.share(&share)?;
                let server = self.server.clone();
                blocking(move || {
                    map::manifest_page(&share, &path, chunk_bytes, first_chunk, &server.manifests)
                })
                .await
            }
            Request::Remove {
                share,
                path,
                recursive,
            } => {
                let share = self.share(&share)?;
                blocking(move || remove::remove(&share, &path, recursive)).await
            }
            Request::DiskUsage { share, path } => {
                let share = self.share(&share)?;
                blocking(move || du::disk_usage(&share, &path)).await
            }
            Request::Verify { share, path } => {
                let share = self.share(&share)?;
                blocking(move || verify::verify(&share, &path)).await
            }
            Request::UploadBatch {
                share,
                region,
                files,
            } => {
                let share = self.share(&share)?;
                batch::upload(self.batch_io(), share, region, files).await
            }
            Request::DownloadBatch {
                share,
                paths,
                region,
            } => {
                let share = self.share(&share)?;
                batch::download(self.batch_io(), share, paths, region).await
            }
            // The session answers these itself; one reaching here is a bug there.
            Request::Auth { .. } => Err(remote(
                ErrorKind::Protocol,
                "authentication is handled by the session",
            )),
        }
    }
}

/// Tells the peer why its session is refused with `Message::Refused(error)`, its only
/// message, and closes the connection once the peer has closed its side (reading and
/// discarding what it sends meanwhile, its `Hello`), so that the refusal is not lost to
/// a reset of a socket closed with unread data. The caller bounds the wait.
pub(crate) async fn refuse(transport: SharedTransport, error: RemoteError) {
    match codec::encode(&Message::Refused(error)) {
        Ok(bytes) => {
            let _ = transport.send(bytes).await;
        }
        Err(e) => tracing::error!("cannot encode a refusal: {e}"),
    }
    transport.close();
    while let Ok(Some(_)) = transport.recv().await {}
}

fn not_a(id: u64, what: &str) -> RemoteError {
    remote(ErrorKind::Protocol, format!("transfer {id} is not {what}"))
}

/// Runs a blocking filesystem call off the async worker threads.
pub(crate) async fn blocking<T, F>(f: F) -> Result<T, RemoteError>
where
    T: Send + 'static,
    F: FnOnce() -> Result<T, RemoteError> + Send + 'static,
{
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| remote(ErrorKind::Io, format!("server task failed: {e}")))?
}
