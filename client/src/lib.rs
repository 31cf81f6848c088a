//! The Ferry client library, and the engine behind `rcp`.
//!
//! - [`client::Client`]: one connection and session to ferryd; metadata calls.
//! - [`transfer`]: upload and download of one file. Uploads register the mmapped
//!   source window read-only and let the server PULL it (RDMA READ); downloads register
//!   pooled anonymous buffers writable and let the server PUSH into them (RDMA WRITE).
//!   Every chunk is checked against its SHA-256; downloads appear under their final
//!   name only after every chunk verified. A copy cut short resumes when run again:
//!   chunks the destination's partial file holds are verified there and not sent
//!   ([`transfer::Copied`] says how many bytes were sent and reused).
//! - [`batch`]: small files many per request, their bytes in one registered buffer
//!   that the server READs or WRITEs with one operation.
//! - [`copy`]: cp/scp semantics for files and trees, with files in flight concurrently;
//!   [`progress`]: the progress callbacks copies and backups report to.
//! - [`walk`]: the local tree walk, and [`schedule`]: the job scheduler (lanes of
//!   work, each with its own limit in flight), both shared by `rcp -r` and backups.
//! - [`backup`]: snapshot backups into `SHARE/PREFIX/<timestamp>/`, unchanged files
//!   hard-linked to the previous snapshot, changed files sent as changed chunks, the
//!   whole tree with many requests in flight; [`backup::admin`]: listing a prefix's
//!   snapshots with their sizes, retention, and removal of stale partial snapshots;
//!   [`backup::verify`]: the server re-reading a snapshot's files and comparing them
//!   with the manifests it recorded; [`filter`]: the include/exclude rules.
//! - [`location`]: parsing `HOST[:PORT]:SHARE/PATH` operands.
//!
//! The library prints nothing and decides no exit codes: it returns typed reports and
//! [`ClientError`]s. Printing, `--json` output and exit codes are `rcp`'s (its `cli`
//! module, beside `main.rs`).
//!
//! ```no_run
//! # async fn demo() -> Result<(), ferry_client::error::ClientError> {
//! use std::sync::Arc;
//! let client = ferry_client::client::Client::connect(
//!     "127.0.0.1",
//!     7447,
//!     ferry_common::transport::TransportChoice::Auto,
//! )
//! .await?;
//! let progress: ferry_client::transfer::ProgressFn = Arc::new(|_bytes| {});
//! ferry_client::transfer::upload_file(&client, "big.bin".as_ref(), "data", "big.bin", progress).await?;
//! # Ok(()) }
//! ```
#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod backup;
pub mod batch;
pub mod client;

pub mod copy;
pub mod error;
pub mod etcd_error;
pub mod files;
pub mod filter;
pub mod links;
pub mod location;
pub mod locks;
pub mod posix;
pub mod progress;
pub mod schedule;
pub mod transfer;
pub mod walk;
pub mod xattrs;

pub use client::{Client, Credentials};
pub use error::ClientError;
