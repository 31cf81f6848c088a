//! Ferry's shared core: the wire protocol, chunk manifests, the sans-IO session and
//! transfer state machines, and the transports that move bytes.
//!
//! Data flow of a copy (see `docs/design.md` for the picture):
//!
//! - Control messages ([`msg::Message`]) carry only metadata, region descriptors
//!   ([`msg::RegionDesc`]) and SHA-256 chunk hashes. They are encoded by [`codec`] and
//!   travel as transport control frames.
//! - File data moves only by one-sided operations of a [`transport::Transport`]: the
//!   server RDMA-READs uploads out of the client's registered, mmapped source window and
//!   RDMA-WRITEs downloads into the client's registered buffers.
//! - [`chunk`] splits files into chunks (1 MiB by default) and hashes them on all cores;
//!   the manifest hash names a file version.
//! - [`proto`] holds the session and transfer logic with no sockets and no clock reads;
//!   the server and client crates are thin tokio drivers around it.
//! - [`auth`] holds share secrets and the HMAC challenge-response of the handshake.
//! - [`path`] validates share-relative paths before the server touches the disk.
//! - [`space`] reserves a received file's size before its bytes arrive, so a full disk
//!   fails a file at its start.
//! - [`direct`] writes the aligned blocks of big received files with `O_DIRECT`,
//!   bypassing the page cache.
//! - [`readahead`] starts the reads of a window of small files at once, so cold
//!   files of a batch are not read one disk read at a time.
//! - [`staging`] holds a received file under a hidden name until it is complete; a
//!   file of several chunks is a resumable partial whose [`journal`] records the chunks
//!   written, so an interrupted transfer of it can resume.
//! - [`units`] parses durations and sizes as administrators type them.
#![warn(missing_docs)]

pub mod attr;
pub mod auth;
pub mod chunk;
pub mod codec;
pub mod direct;
pub mod journal;
pub mod locks;
pub mod msg;
pub mod path;
pub mod proto;
pub mod readahead;
pub mod seal;
pub mod space;
pub mod staging;
pub mod transport;
pub mod units;
pub mod unnamed;
pub mod writeback;
pub mod xattr;

/// The TCP port ferryd listens on unless told otherwise.
pub const DEFAULT_PORT: u16 = 7447;

/// Prefix of the hidden temporary files a transfer writes before its final rename.
/// Names starting with it are never listed and never a valid transfer target.
pub const TEMP_PREFIX: &str = ".ferry-tmp.";

/// Name of the directory at the root of a writable share where ferryd keeps its state
/// (the persistent manifest store). Reserved: no request can name, list or reach it,
/// and the startup cleaner leaves it alone.
pub const STATE_DIR: &str = ".ferry-state";
