//! `ferry-mount`: a FUSE share whose file reads are one-sided RDMA READs of the
//! server's memory, each chunk verified against its hash before any byte of it reaches
//! a reader, and whose writes wait in registered buffers until the server pulls them
//! with one-sided READs and verifies them. A cluster share
//! (`cluster://ETCD/SHARE`) mounts through its own filesystem, [`cluster`]: metadata
//! from etcd, each stripe read from any replica whose chunks verify against the
//! layout's manifest, files written whole at close (read-write unless `-o ro`).
//!
//! - [`fs`]: the FUSE filesystem (fuser), handing every request to tokio tasks.
//! - [`nodes`]: node ids, the attribute cache and the negative cache.
//! - [`reader`]: open files — manifest, one-sided chunk fetches, verification,
//!   readahead. Where each READ goes (and whether the server's mapping can be trusted)
//!   is decided by the sans-IO [`ferry_common::proto::mapped::MappedLayout`].
//! - [`cache`]: the bounded cache of verified chunks.
//! - [`bufs`]: reply buffers reused across reads.
//! - [`remote`]: the connection, reconnection, timeouts and registered fetch buffers.
//! - [`writer`]: files open for writing — the write-back cache, staged files, syncs.
//! - [`locks`]: `fcntl` and `flock` locks held by the server for every client.
//! - [`options`]: `-o` parsing.
//! - [`mount`]: mount(2) as `fuse.ferry`, and unmounting.
//! - [`cluster`]: the mount of a cluster share (names from etcd, stripes through one
//!   [`remote::Remote`] and [`reader::Reader`] per storage node, writes staged and
//!   published whole at close).
//!
//! For a single-server share, metadata (lookup, getattr, readdir, readlink, statfs)
//! travels as control messages; see `docs/design.md` ("The FUSE mount", and its
//! "Cluster mount" part) for the whole picture.
#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod bufs;
pub mod cache;
pub mod cluster;
pub mod fs;
pub mod locks;
pub mod mount;
pub mod nodes;
pub mod options;
pub mod reader;
pub mod remote;
pub mod writer;
