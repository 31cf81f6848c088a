//! The per-connection driver task: completions and rdma_cm events, dispatched.
//!
//! It sleeps on two fds through `AsyncFd` (the CQ's completion channel and the
//! connection's rdma_cm channel) and never spins. It ends once the connection is
//! disconnected and every posted work request has completed (flushed), or after
//! [`DRAIN_GRACE`] if the device never flushes them; the QP is destroyed only when the
//! last handle to the connection drops, after which the device no longer touches any
//! memory.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use rdma_sys::rdma_cm_event_type as ev;
use tokio::io::unix::AsyncFd;

use super::flow::Received;
use super::{lock, op_error, wr, Ctrl, Shared, CTRL_BACKLOG, SEND_SLOTS};
use crate::transport::sys::verbs::{Completion, Watch};
use crate::transport::TransportError;

/// How long a disconnected connection waits for its flushed completions.
const DRAIN_GRACE: Duration = Duration::from_secs(5);

pub(super) async fn run(shared: Arc<Shared>, cq_fd: AsyncFd<Watch>, cm_fd: AsyncFd<Watch>) {
    let mut completions = Vec::with_capacity(64);
    let mut deadline: Option<tokio::time::Instant> = None;
    // Completions may have arrived between connection set-up and now.
    poll_all(&shared, &mut completions);
    loop {
        if shared.disconnected.load(Ordering::SeqCst) {
            if drained(&shared) {
                break;
            }
            let d = *deadline.get_or_insert_with(|| tokio::time::Instant::now() + DRAIN_GRACE);
            if tokio::time::Instant::now() >= d {
                tracing::warn!(peer = %shared.peer, "rdma: work requests not flushed in time");
                break;
            }
        }
        let grace = deadline.unwrap_or_else(|| tokio::time::Instant::now() + DRAIN_GRACE);
        tokio::select! {
            ready = cq_fd.readable() => {
                let Ok(mut ready) = ready else { break };
                if let Err(e) = shared.cq.take_notifications() {
                    shared.fail(e);
                }
                ready.clear_ready();
                poll_all(&shared, &mut completions);
            }
            ready = cm_fd.readable() => {
                let Ok(mut ready) = ready else { break };
                loop {
                    match shared.channel.next_event() {
                        Ok(Some(e)) => on_cm_event(&shared, e.kind, &e.name()),
                        Ok(None) => break,
                        Err(e) => {
                            shared.fail(e);
                            break;
                        }
                    }
                }
                ready.clear_ready();
            }
            _ = tokio::time::sleep_until(grace), if deadline.is_some() => {}
        }
    }
    // Whatever has not completed by now never will: its waiters learn the connection
    // is gone, and so does the application's next `recv` (after the messages it has).
    for (_, p) in lock(&shared.pending).drain() {
        let _ = p.done.send(Err(TransportError::Closed));
    }
    let peer_closed = lock(&shared.ctrl).peer_closed;
    let _ = shared.ctrl_tx.send(if peer_closed {
        Ctrl::End
    } else {
        Ctrl::Failed(TransportError::Closed)
    });
    drop(cq_fd);
    drop(cm_fd);
}

/// True when nothing posted is left: every receive, send and RDMA work request has
/// completed.
fn drained(shared: &Shared) -> bool {
    let st = lock(&shared.ctrl);
    st.recv_posted == 0 && st.free_send.len() == SEND_SLOTS && shared.qp.outstanding() == 0
}

fn poll_all(shared: &Shared, completions: &mut Vec<Completion>) {
    loop {
        completions.clear();
        match shared.cq.poll(completions, 256) {
            Ok(0) => return,
            Ok(_) => {
                for c in completions.iter() {
                    on_completion(shared, c);
                }
            }
            Err(e) => {
                shared.fail(e);
                return;
            }
        }
    }
}

fn on_cm_event(shared: &Shared, kind: u32, name: &str) {
    match kind {
        ev::RDMA_CM_EVENT_DISCONNECTED => {
            tracing::debug!(peer = %shared.peer, "rdma: disconnected");
            shared.disconnect();
        }
        ev::RDMA_CM_EVENT_DEVICE_REMOVAL => {
            shared.fail(TransportError::Unavailable(
                "the RDMA device was removed".into(),
            ));
        }
        _ => tracing::debug!(peer = %shared.peer, "rdma: ignoring {name}"),
    }
}

fn on_completion(shared: &Shared, c: &Completion) {
    let index = c.wr_id & wr::MASK;
    match c.wr_id & !wr::MASK {
        wr::RECV => on_recv(shared, index as usize, c),
        wr::SEND => on_send(shared, index as usize, c),
        wr::RDMA => {
            shared.qp.retire(c.wr_id);
            let Some(p) = lock(&shared.pending).remove(&index) else {
                return;
            };
            if c.ok() {
                let _ = p.done.send(Ok(()));
                return;
            }
            if !c.flushed() {
                // On an RC QP any failed work request moves the QP to the error state:
                // the connection is over. The caller gets the precise error; recv gets
                // it too, so a driver blocked on control messages learns why.
                let e = op_error(&p, c);
                tracing::warn!(peer = %shared.peer, "rdma: {e}");
                shared.fail(op_error(&p, c));
                let _ = p.done.send(Err(e));
            } else {
                let _ = p.done.send(Err(TransportError::Closed));
            }
        }
        _ => shared.fail(TransportError::Protocol(format!(
            "completion with unknown work request id {:#x}",
            c.wr_id
        ))),
    }
}

fn on_recv(shared: &Shared, slot: usize, c: &Completion) {
    let mut st = lock(&shared.ctrl);
    st.recv_posted -= 1;
    if !c.ok() {
        st.recv_ring.complete(slot, 0);
        drop(st);
        if !c.flushed() {
            shared.fail(TransportError::WorkRequest {
                op: "RECV",
                status: c.status_str(),
            });
        }
        return;
    }
    let frame = st.recv_ring.complete(slot, c.byte_len as usize).to_vec();
    let received = st.flow.on_frame(&frame);
    if !shared.disconnected.load(Ordering::SeqCst) {
        let ctrl = &mut *st;
        let reposted = shared
            .qp
            .post_recv(&mut ctrl.recv_ring, slot, wr::RECV | slot as u64);
        if let Err(e) = reposted {
            drop(st);
            shared.fail(e);
            return;
        }
        st.recv_posted += 1;
        st.flow.on_reposted();
    }
    match received {
        Ok(Received::Message(m)) => {
            let backlog = shared.backlog.fetch_add(1, Ordering::SeqCst) + 1;
            st.flow.set_hold(backlog >= CTRL_BACKLOG);
            let _ = shared.ctrl_tx.send(Ctrl::Message(m));
        }
        Ok(Received::Nothing) => {}
        Ok(Received::Closed) => {
            st.peer_closed = true;
            let _ = shared.ctrl_tx.send(Ctrl::End);
            drop(st);
            // The peer is done and will disconnect; nothing more can be asked of us.
            shared.disconnect();
            return;
        }
        Err(e) => {
            drop(st);
            shared.fail(TransportError::Protocol(e.to_string()));
            return;
        }
    }
    // The frame may have brought credits.
    if let Err(e) = shared.pump(&mut st) {
        drop(st);
        shared.fail(e);
    }
}

fn on_send(shared: &Shared, slot: usize, c: &Completion) {
    let mut st = lock(&shared.ctrl);
    st.send_ring.complete(slot, 0);
    st.free_send.push(slot);
    if !c.ok() {
        drop(st);
        if !c.flushed() {
            shared.fail(TransportError::WorkRequest {
                op: "SEND",
                status: c.status_str(),
            });
        }
        return;
    }
    if st.close_posted {
        if st.free_send.len() == SEND_SLOTS {
            // Our CLOSE and everything before it was delivered: hang up.
            drop(st);
            shared.disconnect();
        }
        return;
    }
    if let Err(e) = shared.pump(&mut st) {
        drop(st);
        shared.fail(e);
    }
}
