//! A client that fails or dies does not take the server down or leave half-written
//! files under their final names; what it leaves is a resumable partial, which the
//! same copy run again continues (`tests/tests/resume.rs` kills at many more points).

use std::thread;
use std::time::{Duration, Instant};

use ferry_tests::{
    assert_entries, assert_files_equal, assert_no_temp_files, assert_only_resumable_temp_files,
    ferrytest, first_difference, rcp_args, spawn_rcp, temp_files, write_random_file, MIB,
    TEMP_PREFIX,
};

ferrytest!(failed_download_then_upload_on_same_server, |env| {
    env.rcp(rcp_args![
        env.remote("missing.bin"),
        env.local("missing.bin")
    ])
    .assert_code(4);
    env.server().assert_running();

    write_random_file(&env.local("f.bin"), 2 * MIB + 5, 1);
    env.rcp(rcp_args![env.local("f.bin"), env.remote("f.bin")])
        .assert_success();
    assert_files_equal(&env.local("f.bin"), &env.share("f.bin"));
    assert_entries(&env.share(""), &["f.bin"]);
    env.server().assert_running();
});

ferrytest!(failing_and_succeeding_clients_at_once, |env| {
    write_random_file(&env.local("f.bin"), 6 * MIB, 2);
    let failing: Vec<_> = (0..3)
        .map(|i| {
            spawn_rcp(rcp_args![
                env.remote(&format!("missing{i}")),
                env.local("x")
            ])
        })
        .collect();
    let good = spawn_rcp(rcp_args![env.local("f.bin"), env.remote("f.bin")]);
    for child in failing {
        child.wait().assert_code(4);
    }
    good.wait().assert_success();
    assert_files_equal(&env.local("f.bin"), &env.share("f.bin"));
    assert_entries(&env.local(""), &["f.bin"]);
    env.server().assert_running();
});

ferrytest!(
    killed_upload_leaves_nothing_half_written_and_resumes,
    |env| {
        let src = env.local("big.bin");
        write_random_file(&src, 64 * MIB, 3);
        let mut child = spawn_rcp(rcp_args![src, env.remote("big.bin")]);
        // Kill it as soon as ferryd's temporary file shows the transfer under way (or give
        // up waiting if the upload finishes first).
        let deadline = Instant::now() + Duration::from_secs(20);
        while Instant::now() < deadline && !has_temp_file(&env.share("")) && child.is_running() {
            thread::sleep(Duration::from_millis(1));
        }
        child.kill();

        // Either the upload finished before the kill, or nothing is under the final name.
        let dst = env.share("big.bin");
        if dst.exists() {
            assert!(
                matches!(first_difference(&src, &dst), Ok(None)),
                "a partial file is visible under the final name"
            );
        }

        // The server goes on serving.
        write_random_file(&env.local("small.bin"), MIB + 3, 4);
        env.rcp(rcp_args![env.local("small.bin"), env.remote("small.bin")])
            .assert_success();
        assert_files_equal(&env.local("small.bin"), &env.share("small.bin"));
        env.server().assert_running();

        // What the aborted transfer leaves is its resumable partial and journal, nothing
        // else; the same upload run again finishes it and leaves nothing.
        assert_only_resumable_temp_files(&env.share(""));
        let out = env.rcp(rcp_args!["--json", src, env.remote("big.bin")]);
        out.assert_success();
        let v = out.json();
        assert_eq!(
            v["bytes_sent"].as_u64().unwrap() + v["bytes_reused"].as_u64().unwrap(),
            64 * MIB,
            "{v}"
        );
        assert_files_equal(&src, &dst);
        assert_no_temp_files(&env.share(""));
    }
);

fn has_temp_file(dir: &std::path::Path) -> bool {
    std::fs::read_dir(dir).unwrap().any(|e| {
        e.unwrap()
            .file_name()
            .to_string_lossy()
            .starts_with(TEMP_PREFIX)
    })
}

ferrytest!(
    interrupted_download_exits_130_and_keeps_only_a_resumable_partial,
    |env| {
        write_random_file(&env.share("big.bin"), 128 * MIB, 5);
        let out_dir = env.local("out");
        std::fs::create_dir(&out_dir).unwrap();
        let mut child = spawn_rcp(rcp_args![env.remote("big.bin"), &out_dir]);
        // Interrupt as soon as rcp's own temporary file shows the download under way.
        let deadline = Instant::now() + Duration::from_secs(20);
        while Instant::now() < deadline && !has_temp_file(&out_dir) && child.is_running() {
            thread::sleep(Duration::from_millis(1));
        }
        let status = std::process::Command::new("kill")
            .args(["-INT", &child.id().to_string()])
            .status()
            .unwrap();
        assert!(status.success());
        let out = child.wait();
        // The download may still win the race between the check above and the signal;
        // then (exit 0) it must be whole.
        if out.code != Some(0) {
            out.assert_code(130).assert_stderr_has("interrupted");
            // Nothing under the final name; at most the hidden partial and its journal.
            assert!(!out_dir.join("big.bin").exists());
            assert_only_resumable_temp_files(&out_dir);
            assert_eq!(
                std::fs::read_dir(&out_dir).unwrap().count(),
                temp_files(&out_dir).len()
            );
        } else {
            // The download won the race; then it must be whole.
            out.assert_success();
            assert_files_equal(&env.share("big.bin"), &out_dir.join("big.bin"));
        }
        env.server().assert_running();
        // The same download again finishes the file and leaves nothing else.
        env.rcp(rcp_args![env.remote("big.bin"), &out_dir])
            .assert_success();
        assert_files_equal(&env.share("big.bin"), &out_dir.join("big.bin"));
        assert_entries(&out_dir, &["big.bin"]);
    }
);
