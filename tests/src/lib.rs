//! Integration-test harness for Ferry: real `ferryd` processes, the real `rcp` binary,
//! loopback TCP.
//!
//! The shape follows ripgrep's `rgtest!` harness. Each test gets an [`Env`]: a fresh
//! temporary directory holding a `local/` side for `rcp` and one directory per share
//! under `shares/`, served by a `ferryd` of its own ([`Server`]). Tests therefore run in
//! parallel without seeing each other, and nothing is written outside temp dirs.
//!
//! ```text
//! <tmp>/local/           files rcp reads and writes
//! <tmp>/shares/<name>/   what ferryd exports as share <name>
//! <ferryd tmp>/port      --port-file; <ferryd tmp>/ferryd.stderr is ferryd's log
//! ```
//!
//! The pieces:
//! - [`ferrytest!`] declares a `#[test]` that receives an [`Env`].
//! - [`Server`] starts `ferryd --listen 127.0.0.1:0 --port-file ...`, waits for the port
//!   file, and kills the process on drop (printing its stderr when the test panicked).
//!   Its shares are guarded by [`TEST_SECRET`], which [`rcp()`], [`Mount`] and
//!   [`connect`] prove.
//! - [`rcp()`] / [`spawn_rcp`] run the real `rcp` with a timeout and return an
//!   [`RcpOutput`] (exit code, stdout, stderr) with assertion helpers.
//! - [`connect`] opens a client-library session with a test server, and
//!   [`raw_handshake`] a [`RawClient`] one that writes TCP-transport frames itself (for
//!   hostile-input tests): every session a test opens starts in [`session`](connect).
//! - [`open_fds`] and [`proc_status`] read a process's open descriptors and memory
//!   (peak RSS) from `/proc`, for leak and memory-bound checks on ferryd.
//! - [`Env::builder`] adds a small [`Tmpfs`] under a share (disk-full tests) and runs
//!   ferryd or rcp as an unprivileged [`User`] (permission tests: root reads anything).
//! - [`files`](write_random_file) and [`tree`](make_tree) helpers write seeded random
//!   files and trees, and compare files and trees byte for byte, with modes, mtimes and
//!   symlink targets; [`assert_only_resumable_temp_files`] and [`journaled_bytes`] look
//!   at what an interrupted copy left for a resumed one.
//! - Proxies for the tcp transport, between a client and ferryd: [`WireProxy`] flips
//!   bits in the READ data it can place in a mapped file; [`TamperProxy`] records every
//!   byte and applies one [`Fault`] (a flipped, dropped, repeated or reordered control
//!   frame, or a flipped data bit) without decoding control payloads, and [`replay`]
//!   sends a recorded client stream to ferryd again.
//! - [`Server::restart`] SIGKILLs ferryd and starts another on the same shares.
//! - A multi-node cluster ([`Cluster`], `cluster.rs`): a real etcd and N ferryd
//!   storage nodes, each in its own network namespace joined to the root one by a veth
//!   pair (`10.A.K.2:7447` for node K; [`Cluster::limit_rate`] shapes a node's link
//!   with `tc`), started with [`ferryd_args`]; [`ferry()`] runs the `ferry` admin tool
//!   and [`Cluster::wait_nodes`] polls its `cluster status --json`. [`NodeMode::Plain`]
//!   runs plain ferryd nodes instead. Needs root and etcd ([`skip_without_cluster`]).
//! - Another release's binaries (the compatibility tests): [`PrevRelease`] finds the
//!   previous release's in `$FERRY_PREV_BIN_DIR`; [`EnvBuilder::server_binary`] and
//!   [`Server::restart_binary`] run a given `ferryd` on the shares, [`rcp_binary`] and
//!   [`spawn_rcp_binary`] a given `rcp`.
//!
//! `cargo test -p ferry-tests` does not build the binaries: run
//! `cargo build --workspace --bins` first. They are looked up in `$FERRY_BIN_DIR`, or
//! else in the directory two levels above the test executable (`target/debug` for
//! `target/debug/deps/<test>`).

#![forbid(unsafe_code)]

mod certs;
mod cluster;
mod env;
mod etcd;
mod files;
mod loopfs;
mod mount;
mod netns;
mod prev;
mod procfs;
mod raw;
mod rcp;
mod relay;
mod secret;
mod server;
mod session;
mod tamper;
mod tmpfs;
mod tools;
mod tree;
mod user;
mod wire_proxy;

pub use certs::{make_certs, Certs, CLIENT_CN};
pub use cluster::{
    ferry, ferryd_args, ferryd_has_cluster_mode, skip_without_cluster, Cluster, ClusterOptions,
    NodeMode, NodeSpec, StoppedNode, FERRY_TIMEOUT, LEASE_TTL, MAX_NODES, NODE_PORT, PLAIN_SHARE,
};
pub use env::{Env, EnvBuilder, DEFAULT_SHARE};
pub use etcd::{
    etcd_healthy, etcd_program, etcdctl_program, skip_without_etcdctl, Etcd, ETCD_STARTUP_TIMEOUT,
};
pub use files::{
    assert_entries, assert_files_equal, assert_no_temp_files, assert_only_resumable_temp_files,
    assert_same_bytes, assert_same_mode_and_mtime, byte_difference, first_difference,
    journaled_bytes, mode_of, mtime_of, set_mode, set_mtime, temp_files, unused_local_port,
    write_random_file, MIB, TEMP_PREFIX,
};
pub use loopfs::LoopExt4;
pub use mount::{
    ferry_mount, fuse_unavailable, is_fuse_type, mount_type, send_signal, skip_without_fuse, Mount,
    MountBuilder, MountFailed, MountOutput, Stopped, FSTYPE, MOUNT_TIMEOUT, UNMOUNT_TIMEOUT,
};
pub use prev::{PrevRelease, PREV_BIN_DIR_VAR};
pub use procfs::{open_fds, proc_status};
pub use raw::{
    ctrl_frame, frame_bytes, msg_frame, Closed, Frame, RawClient, RAW_TIMEOUT, STATUS_DENIED,
    STATUS_INVALID_RKEY, STATUS_OUT_OF_BOUNDS,
};
pub use rcp::{
    rcp, rcp_binary, rcp_env, spawn_rcp, spawn_rcp_as, spawn_rcp_binary, spawn_rcp_env, RcpChild,
    RcpOutput, RCP_TIMEOUT,
};
pub use relay::Direction;
pub use secret::{connect_to, credentials, test_secret, write_secret_file, TEST_SECRET};
pub use server::{bin, bin_dir, Server, ServerOptions, Share, STARTUP_TIMEOUT};
pub use session::{
    connect, hello, raw_greet, raw_handshake, raw_socket, raw_socket_from, read_until_closed,
    wait_connections,
};
pub use tamper::{
    replay, Fault, FaultKind, ReplayOutcome, TamperProxy, RECORDING_CAP_BYTES, SWAP_WAIT,
};
pub use tmpfs::Tmpfs;
pub use tools::{program_on_path, python, run_tool, sh, skip_without_tool, ToolOutput};
pub use tree::{
    assert_trees_equal, assert_trees_identical, make_many_small_files, make_medium_tree,
    make_small_tree, make_tree, TreeStats,
};
pub use user::User;
pub use wire_proxy::{Corruption, Flip, ReadInfo, ReadTarget, WireProxy};

/// Declares a `#[test]` that runs `$body` with a fresh [`Env`] bound to `$env`.
///
/// `ferrytest!(name, |env| { ... })` serves one read-write share, [`DEFAULT_SHARE`].
/// `ferrytest!(name, shares = [("data", false), ("ro", true)], |env| { ... })` serves
/// the listed `(name, read_only)` shares instead.
#[macro_export]
macro_rules! ferrytest {
    ($name:ident, |$env:ident| $body:block) => {
        #[test]
        fn $name() {
            let $env = $crate::Env::new();
            $body
        }
    };
    ($name:ident, shares = [$(($share:expr, $ro:expr)),+ $(,)?], |$env:ident| $body:block) => {
        #[test]
        fn $name() {
            let $env = $crate::Env::with_shares(&[$(($share, $ro)),+]);
            $body
        }
    };
}

/// Builds a `Vec<OsString>` of command-line arguments from anything that is
/// `AsRef<OsStr>` (paths, `String`s, `&str`s), without moving the arguments.
///
/// `rcp_args!["-r", src, env.remote("dst")]`
#[macro_export]
macro_rules! rcp_args {
    ($($arg:expr),* $(,)?) => {
        ::std::vec![$(::std::ffi::OsString::from(
            ::std::convert::AsRef::<::std::ffi::OsStr>::as_ref(&$arg)
        )),*]
    };
}

/// The transport the suite runs rcp on: `FERRY_TEST_TRANSPORT` (`tcp` by default;
/// `scripts/test-rdma.sh` sets `rdma` inside the Soft-RoCE VM).
pub fn test_transport() -> &'static str {
    match std::env::var("FERRY_TEST_TRANSPORT").as_deref() {
        Ok("rdma") => "rdma",
        Ok("tcp") | Err(_) => "tcp",
        Ok(other) => panic!("FERRY_TEST_TRANSPORT={other}: expected tcp or rdma"),
    }
}

/// True under the RDMA suite (in the Soft-RoCE VM, where everything runs 10-15x
/// slower than on the host).
pub fn on_rdma() -> bool {
    test_transport() == "rdma"
}

/// Runs `f` on a thread and panics if it does not finish within `limit` (a hung FUSE
/// call is then ended by the mount's drop, which kills ferry-mount).
#[track_caller]
pub fn within<T: Send + 'static>(
    limit: std::time::Duration,
    what: &str,
    f: impl FnOnce() -> T + Send + 'static,
) -> T {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    match rx.recv_timeout(limit) {
        Ok(value) => value,
        Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {
            panic!("{what} did not finish within {limit:?}")
        }
        Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => {
            panic!("{what} panicked (see above)")
        }
    }
}

/// The address test servers listen on: `FERRY_TEST_ADDR` (`127.0.0.1` by default; the
/// RDMA device's address under the RDMA suite, since rdma_cm cannot route loopback).
pub fn test_host() -> String {
    std::env::var("FERRY_TEST_ADDR").unwrap_or_else(|_| "127.0.0.1".into())
}

/// The transport choice for in-process clients of a test server.
pub fn test_choice() -> ferry_common::transport::TransportChoice {
    test_transport().parse().expect("tcp or rdma")
}

/// A two-worker tokio runtime for tests that drive a [`ferry_client::Client`] directly.
pub fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("a tokio runtime")
}
