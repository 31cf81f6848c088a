//! Never EIO from load (issue 42, point 5):
//! - a ferryd whose mapped-bytes budget holds only two of the files at once, read whole
//!   by many readers at once through two mounts. Opens the server refuses as `Busy`
//!   wait and try again within the mount's timeout; every read returns the file's exact
//!   bytes, none fails, and the mounts' logs show the busy answers were given;
//! - a ferryd at its connection limit: a mount's connection (its first, or a
//!   reconnection: one code path) refused `Busy` is tried again within the timeout, and
//!   succeeds once a slot is free.

use std::fs;
use std::thread;
use std::time::{Duration, Instant};

use ferry_tests::{raw_socket, skip_without_fuse, write_random_file, Env, Mount};

const FILES: usize = 8;
const FILE_BYTES: usize = 2 << 20;

#[test]
fn readers_beyond_the_mapped_budget_wait_and_get_exact_bytes() {
    if skip_without_fuse("readers_beyond_the_mapped_budget_wait_and_get_exact_bytes") {
        return;
    }
    let env = Env::builder()
        .server_arg(format!("--max-mapped-bytes={}", 2 * FILE_BYTES))
        .start();
    for i in 0..FILES {
        write_random_file(&env.share(&format!("f{i}")), FILE_BYTES as u64, i as u64);
    }
    let mounts = [Mount::start(env.remote("")), Mount::start(env.remote(""))];
    let want: Vec<Vec<u8>> = (0..FILES)
        .map(|i| fs::read(env.share(&format!("f{i}"))).unwrap())
        .collect();
    thread::scope(|s| {
        for round in 0..3 {
            for (m, mount) in mounts.iter().enumerate() {
                for (i, want) in want.iter().enumerate() {
                    let path = mount.join(&format!("f{i}"));
                    s.spawn(move || {
                        let got = fs::read(&path).unwrap_or_else(|e| {
                            panic!("round {round}, mount {m}, {}: {e}", path.display())
                        });
                        assert!(got == *want, "{}: wrong bytes", path.display());
                    });
                }
            }
        }
    });
    let busy: usize = mounts
        .iter()
        .map(|m| m.log_lines_with(&["server busy, trying again"]).len())
        .sum();
    assert!(busy > 0, "the load never made the server answer Busy");
    for m in mounts {
        m.unmount();
    }
}

/// A mount started while ferryd is at its connection limit (`--max-connections 1`, the
/// slot held by an idle socket) is refused `Busy`, tries again, and mounts once the
/// slot is free: the file reads back whole, and both logs show the refusal happened.
#[test]
fn a_mount_refused_at_the_connection_limit_waits_for_a_slot() {
    if skip_without_fuse("a_mount_refused_at_the_connection_limit_waits_for_a_slot") {
        return;
    }
    let env = Env::builder().server_arg("--max-connections=1").start();
    write_random_file(&env.share("f"), 100_000, 5);
    let hog = raw_socket(env.server());
    let remote = env.remote("");
    let mounting = thread::spawn(move || Mount::start(remote));
    // The mount has been refused once ferryd says so; then the slot frees.
    let start = Instant::now();
    while !env
        .server()
        .stderr()
        .contains("refused: server at its connection limit")
    {
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "ferryd never refused the mount:\n{}",
            env.server().stderr()
        );
        thread::sleep(Duration::from_millis(10));
    }
    drop(hog);
    let mount = mounting.join().expect("the mount waited for a slot");
    assert_eq!(
        fs::read(mount.join("f")).unwrap(),
        fs::read(env.share("f")).unwrap()
    );
    assert!(
        !mount
            .log_lines_with(&["server busy, trying again"])
            .is_empty(),
        "the mount did not say it waited:\n{}",
        mount.log()
    );
    mount.unmount();
}
