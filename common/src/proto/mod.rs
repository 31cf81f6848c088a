//! The sans-IO protocol core: no sockets, no tasks, no clock reads.
//!
//! - [`client::ClientSession`] and [`server::ServerSession`] run the handshake, match
//!   responses to requests and police message order and request limits.
//! - [`batch`] checks batches of small files: a server admits an upload batch as a
//!   whole, a client takes only download placements inside its region.
//! - [`caps`] negotiates the session's capabilities in the handshake.
//! - [`conn`] holds a server connection's open transfers and mapped files, admits each
//!   request against them and settles it from its answer.
//! - [`manifest`] reads a file's chunk manifest page by page and verifies it.
//! - [`retry`] decides when a client sends a failed transfer window (or a batched file)
//!   again.
//! - [`transfer`] holds the window geometry and bookkeeping of uploads and downloads:
//!   which windows a client asks for, which chunks a window holds, and when an upload
//!   may commit.
//! - [`mapped::MappedLayout`] checks the geometry a server announces for a mapped file
//!   once, then places every one-sided read of it (manifest, chunk runs, read spans).
//!
//! Inputs are `handle_*` methods taking the current time; outputs are drained with
//! `poll_transmit`, `poll_event` and `poll_timeout`. Drivers (server, client, fuse
//! crates) feed every received message in, drain every output, and arm one timer at
//! `poll_timeout()`. The test-only `pair` module drives both cores in memory, with a
//! simulated clock, a simulated server driver and fault injection.

use std::time::Duration;

pub mod batch;
pub mod caps;
pub mod client;
pub mod conn;
pub mod manifest;
pub mod mapped;
pub mod retry;
pub mod server;
pub mod timer;
pub mod transfer;

#[cfg(test)]
mod pair;

use crate::codec::CodecError;
use crate::msg::{ErrorKind, RemoteError};

/// How long a session may take to complete its handshake.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// How long a client waits with requests outstanding and nothing heard from the
/// server before it probes the server ([`client::Liveness`]).
pub const PROBE_AFTER: Duration = Duration::from_secs(1);

/// How long a client waits with requests outstanding and nothing at all heard from
/// the server (no response, no answer to its probes) before it ends the session as
/// hung. A live server answers probes from its connection task even while its requests
/// wait on the disk (a long fsync), so only a server that cannot run at all (stopped,
/// its machine frozen, the path to it black-holed) reaches this. Ten seconds: far
/// above a probe's round trip on a loaded two-core machine, far below TCP's own
/// retransmission give-up (minutes) and the encrypted transport's silence limit.
pub const SERVER_SILENCE_LIMIT: Duration = Duration::from_secs(10);

/// Most requests a client may have outstanding on one session.
pub const MAX_INFLIGHT_REQUESTS: u32 = 256;

/// A broken rule of the protocol. Fatal to the session that sees it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ProtoError {
    /// The bytes did not decode.
    #[error(transparent)]
    Codec(#[from] CodecError),
    /// A message arrived that is not allowed in the session's current state.
    #[error("unexpected {got} while {state}")]
    Unexpected {
        /// What arrived.
        got: &'static str,
        /// What the session was doing.
        state: &'static str,
    },
    /// The peer does not speak this protocol (bad magic) or no common version.
    #[error("incompatible peer: {0}")]
    Incompatible(String),
    /// The server refused the session (its kind: `Busy` at its connection limit).
    #[error("server refused the session: {}", .0.message)]
    Refused(RemoteError),
    /// A response named a request that is not outstanding.
    #[error("response to unknown request {0}")]
    UnknownRequest(u64),
    /// A request reused the id of an outstanding one.
    #[error("request id {0} is already outstanding")]
    DuplicateRequest(u64),
    /// The client exceeded [`MAX_INFLIGHT_REQUESTS`].
    #[error("more than {0} requests outstanding")]
    TooManyRequests(u32),
    /// The handshake did not finish in time.
    #[error("handshake timed out")]
    HandshakeTimeout,
    /// A transfer request broke the window rules.
    #[error("{0}")]
    Transfer(String),
    /// The client's proof of a share's secret was wrong.
    #[error("authentication failed for share '{0}'")]
    AuthFailed(String),
    /// A chunk's bytes do not hash to the hash announced for them: damaged in flight
    /// (or changed at the source).
    #[error("chunk {0} does not match its hash")]
    ChunkMismatch(u64),
    /// Requests were outstanding and the server sent nothing, not even an answer to a
    /// probe, for this long: it is hung (stopped, frozen) or the path to it is.
    #[error("the server sent nothing for {0:?} while requests waited (liveness probes unanswered): it is hung or unreachable")]
    ServerSilent(Duration),
    /// The server's proof of a share's secret was wrong: it does not know the secret.
    #[error("the server could not prove it knows the secret of share '{0}'")]
    ServerNotAuthentic(String),
}

impl ProtoError {
    /// The [`ErrorKind`] to report to a peer for this error.
    pub fn kind(&self) -> ErrorKind {
        ErrorKind::Protocol
    }
}
