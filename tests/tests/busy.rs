//! Never EIO from load (issue 42, point 5): a ferryd whose mapped-bytes budget holds
//! only two of the files at once, read whole by many readers at once through two
//! mounts. Opens the server refuses as `Busy` wait and try again within the mount's
//! timeout; every read returns the file's exact bytes, none fails, and the mounts' logs
//! show the busy answers were given.

use std::fs;
use std::thread;

use ferry_tests::{skip_without_fuse, write_random_file, Env, Mount};

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
