//! `rcp`'s side of the library's results: the `rcp backup` command, printing, `--json`
//! objects and exit codes. The library ([`ferry_client`]) returns typed reports and
//! errors; everything the user sees is decided here and in `main.rs`.
//!
//! - [`backup`]: `rcp backup`'s arguments, and running it on every target.
//! - `admin`: `rcp backup --list`, and how snapshots and pruning are shown.
//! - `verify`: `rcp backup --verify`.
//! - `target`: connecting to a backup command's target (a node's or a cluster's).
//! - [`exit`]: the exit codes, and the code of each error.
//! - [`progress`]: the progress bar.

mod admin;
pub mod backup;
pub mod exit;
pub mod progress;
mod target;
mod verify;
