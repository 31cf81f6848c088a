//! The only module of the workspace with `unsafe` code: safe wrappers over the
//! foreign interfaces Ferry needs.
//!
//! - [`mem`]: file mappings and anonymous buffers (memmap2), and the SIGBUS reporter.
//! - [`cached`]: whether a file range is in the page cache (`mincore`), for readers
//!   that take cold data with direct I/O.
//! - [`at`]: opening a name relative to a directory descriptor (`openat`) as an owned
//!   file, for ferryd's descriptor-relative path work.
//! - [`creds`]: acting as another user on one thread (file-system ids and
//!   supplementary groups), for ferryd's shares whose owners are the clients'.
//! - `verbs` (feature `rdma`): RAII wrappers over libibverbs and librdmacm (rdma-sys).
//!
//! Every `unsafe` block carries a `// SAFETY:` comment stating why the call is sound.
//! Everything outside this module is checked by the compiler alone (`unsafe_code` is
//! denied workspace-wide and only allowed here).
#![allow(unsafe_code)]

pub mod at;
pub mod cached;
pub mod creds;
pub mod mem;

#[cfg(feature = "rdma")]
pub mod verbs;
