//! `rcp`'s copy jobs: cp/scp semantics for files and trees, in both directions.
//!
//! A copy is planned first (every source resolved, trees walked: local ones by the
//! walk backups use too, [`crate::walk`]), then executed: directories are created
//! (owner-writable) parents first, files and symlinks are copied with at most `jobs`
//! files (or batches of small files, see [`crate::batch`]) in flight on the scheduler
//! backups use too ([`crate::schedule`]), and finally directory modes and mtimes are
//! set deepest first, so that creating children does not disturb a parent's mtime.
//! A failing item is recorded and the rest of the copy goes on.
//!
//! Modules: `plan` (what a copy will do, and its options) and `report` (what it did,
//! recorded item by item), then the two directions that use them: `upload` (local
//! to server, whose files start while deeper directories are still being made:
//! `gate`) and `download` (server to local); `xattrs` carries extended attributes
//! after either (`-X`).

mod download;
mod gate;
mod plan;
mod report;
mod upload;
mod xattrs;

pub use download::download;
pub use plan::CopyOptions;
pub use report::{ItemError, Report};
pub use upload::upload;
