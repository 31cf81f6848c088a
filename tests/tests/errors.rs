//! Failures: exit codes from the CLI contract, and an error line in the contract's
//! format `rcp: PATH: CAUSE` naming the argument and the cause; nothing created where
//! the operation was refused.

use std::fs;
use std::os::unix::fs::symlink;
use std::time::Duration;

use ferry_tests::{
    assert_entries, assert_files_equal, assert_no_temp_files, ferrytest, make_small_tree, rcp_args,
    unused_local_port, write_random_file, Env, MIB,
};

/// Words a refusal for a path outside the share may use.
const OUTSIDE_WORDS: &[&str] = &["escape", "outside"];

/// Words a refusal to follow a symlink out of the share may use.
const SYMLINK_ESCAPE_WORDS: &[&str] = &["escape", "outside", "symlink", "permission denied"];

/// Words for a missing file.
const NOT_FOUND_WORDS: &[&str] = &["not found", "no such file"];

ferrytest!(upload_to_missing_share_exits_4, |env| {
    write_random_file(&env.local("f"), 10, 1);
    let remote = env.remote_in("nosuch", "x");
    let out = env.rcp(rcp_args![env.local("f"), remote]);
    out.assert_code(4)
        .assert_stderr_has_any(&["no such share 'nosuch'"])
        .assert_error_line(&remote, &["no such share"]);
});

ferrytest!(download_from_missing_share_exits_4, |env| {
    let remote = env.remote_in("nosuch", "x");
    let out = env.rcp(rcp_args![remote, env.local("x")]);
    out.assert_code(4)
        .assert_stderr_has_any(&["no such share 'nosuch'"])
        .assert_error_line(&remote, &["no such share"]);
    assert_entries(&env.local(""), &[]);
});

#[test]
fn connection_refused_exits_3_quickly() {
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("f");
    write_random_file(&src, 10, 2);
    let port = unused_local_port();
    let host = ferry_tests::test_host();
    let remote = format!("{host}:{port}:data/x");

    let out = ferry_tests::rcp(rcp_args![src, remote]);
    // TCP says "refused"; RDMA's connection manager says "rejected".
    out.assert_code(3)
        .assert_stderr_has_any(&["connection refused", "rejected"])
        .assert_stderr_has(&format!("{host}:{port}"));
    assert!(
        out.elapsed < Duration::from_secs(10),
        "rcp took {:?} to notice nothing listens",
        out.elapsed
    );

    let out = ferry_tests::rcp(rcp_args![remote, dir.path().join("back")]);
    out.assert_code(3)
        .assert_stderr_has_any(&["connection refused", "rejected"]);
    assert!(
        out.elapsed < Duration::from_secs(10),
        "took {:?}",
        out.elapsed
    );
    assert!(!dir.path().join("back").exists());
}

ferrytest!(remote_file_not_found_exits_4, |env| {
    let remote = env.remote("missing.bin");
    let out = env.rcp(rcp_args![remote, env.local("out")]);
    out.assert_code(4)
        .assert_error_line(&remote, NOT_FOUND_WORDS);
    assert_entries(&env.local(""), &[]);
});

ferrytest!(local_source_missing_exits_5, |env| {
    let local = env.local("nothere.bin");
    let out = env.rcp(rcp_args![local, env.remote("x")]);
    out.assert_code(5)
        .assert_error_line(&local, NOT_FOUND_WORDS);
    assert_entries(&env.share(""), &[]);
});

ferrytest!(one_missing_source_does_not_stop_the_others, |env| {
    write_random_file(&env.local("a.bin"), MIB + 1, 3);
    write_random_file(&env.local("b.bin"), 77, 4);
    let missing = env.local("nothere.bin");
    let out = env.rcp(rcp_args![
        env.local("a.bin"),
        missing,
        env.local("b.bin"),
        env.remote("")
    ]);
    out.assert_code(5)
        .assert_error_line(&missing, NOT_FOUND_WORDS);
    assert_entries(&env.share(""), &["a.bin", "b.bin"]);
    assert_files_equal(&env.local("a.bin"), &env.share("a.bin"));
    assert_files_equal(&env.local("b.bin"), &env.share("b.bin"));
});

ferrytest!(failures_of_different_kinds_exit_1, |env| {
    write_random_file(&env.local("ok.bin"), 100, 5);
    fs::create_dir(env.local("adir")).unwrap();
    // A missing local file (5) and a directory without -r (2).
    let (missing, dir) = (env.local("nothere.bin"), env.local("adir"));
    let out = env.rcp(rcp_args![missing, dir, env.local("ok.bin"), env.remote("")]);
    out.assert_code(1)
        .assert_error_line(&missing, NOT_FOUND_WORDS)
        .assert_error_line(&dir, &[]);
    assert_entries(&env.share(""), &["ok.bin"]);
});

ferrytest!(both_sides_local_is_a_usage_error, |env| {
    write_random_file(&env.local("a"), 10, 6);
    env.rcp(rcp_args![env.local("a"), env.local("b")])
        .assert_code(2);
    assert_entries(&env.local(""), &["a"]);
});

ferrytest!(both_sides_remote_is_a_usage_error, |env| {
    write_random_file(&env.share("a"), 10, 7);
    env.rcp(rcp_args![env.remote("a"), env.remote("b")])
        .assert_code(2);
    assert_entries(&env.share(""), &["a"]);
});

ferrytest!(
    read_only_share_refuses_upload,
    shares = [("data", false), ("ro", true)],
    |env| {
        write_random_file(&env.local("f.bin"), 2 * MIB, 8);
        let remote = env.remote_in("ro", "f.bin");
        let out = env.rcp(rcp_args![env.local("f.bin"), remote]);
        out.assert_code(4)
            .assert_error_line(&remote, &["read-only"]);
        assert_entries(&env.share_dir("ro"), &[]);
    }
);

ferrytest!(
    read_only_share_refuses_mkdir,
    shares = [("data", false), ("ro", true)],
    |env| {
        make_small_tree(&env.local("tree"), 9);
        let remote = env.remote_in("ro", "newdir");
        let out = env.rcp(rcp_args!["-r", env.local("tree"), remote]);
        out.assert_code(4)
            .assert_error_line(&remote, &["read-only"]);
        assert_entries(&env.share_dir("ro"), &[]);
    }
);

ferrytest!(
    read_only_share_serves_downloads,
    shares = [("data", false), ("ro", true)],
    |env| {
        let file = env.share_dir("ro").join("f.bin");
        write_random_file(&file, MIB + 9, 10);
        env.rcp(rcp_args![env.remote_in("ro", "f.bin"), env.local("f.bin")])
            .assert_success();
        assert_files_equal(&file, &env.local("f.bin"));
    }
);

/// Uploads to `data/<hostile>`: refused client-side (2) or by the server (4), with the
/// argument and the cause on stderr; nothing appears next to the share.
fn hostile_upload(env: &Env, hostile: &str) {
    write_random_file(&env.local("x"), 10, 11);
    let remote = env.remote(hostile);
    let out = env.rcp(rcp_args![env.local("x"), remote]);
    out.assert_code_in(&[2, 4])
        .assert_error_line(&remote, OUTSIDE_WORDS);
    assert_entries(&env.root().join("shares"), &["data"]);
    assert!(!env.root().join("x").exists());
}

/// Downloads `data/<hostile>`, which names `<tmp>/shares/secret` outside the share:
/// refused with the argument and the cause on stderr; nothing is copied.
fn hostile_download(env: &Env, hostile: &str) {
    write_random_file(&env.root().join("shares/secret"), 10, 12);
    let remote = env.remote(hostile);
    let out = env.rcp(rcp_args![remote, env.local("stolen")]);
    out.assert_code_in(&[2, 4])
        .assert_error_line(&remote, OUTSIDE_WORDS);
    assert_entries(&env.local(""), &[]);
}

ferrytest!(upload_to_dotdot_path_is_refused, |env| {
    hostile_upload(&env, "../x");
    assert_entries(&env.share(""), &[]);
});

ferrytest!(upload_to_nested_dotdot_path_is_refused, |env| {
    fs::create_dir(env.share("a")).unwrap();
    hostile_upload(&env, "a/../../x");
    assert_entries(&env.share(""), &["a"]);
    assert_entries(&env.share("a"), &[]);
});

ferrytest!(download_of_dotdot_path_is_refused, |env| {
    hostile_download(&env, "../secret");
});

ferrytest!(download_of_nested_dotdot_path_is_refused, |env| {
    fs::create_dir(env.share("a")).unwrap();
    hostile_download(&env, "a/../../secret");
});

/// Builds `<tmp>/outside/secret.txt` and, inside the share, `out_dir -> <tmp>/outside`,
/// `out_file -> <tmp>/outside/secret.txt` and `rel_out -> ../../outside/secret.txt`.
/// Returns the secret's content.
fn plant_escaping_symlinks(env: &Env) -> Vec<u8> {
    let outside = env.root().join("outside");
    fs::create_dir(&outside).unwrap();
    let secret = b"top secret\n".to_vec();
    fs::write(outside.join("secret.txt"), &secret).unwrap();
    symlink(&outside, env.share("out_dir")).unwrap();
    symlink(outside.join("secret.txt"), env.share("out_file")).unwrap();
    symlink("../../outside/secret.txt", env.share("rel_out")).unwrap();
    secret
}

ferrytest!(download_through_symlink_out_of_share_is_refused, |env| {
    plant_escaping_symlinks(&env);
    for path in ["out_dir/secret.txt", "out_file", "rel_out"] {
        let remote = env.remote(path);
        let out = env.rcp(rcp_args![remote, env.local("stolen")]);
        out.assert_code(4)
            .assert_error_line(&remote, SYMLINK_ESCAPE_WORDS);
        assert_entries(&env.local(""), &[]);
    }
});

ferrytest!(
    upload_through_symlink_out_of_share_creates_nothing_outside,
    |env| {
        let secret = plant_escaping_symlinks(&env);
        let outside = env.root().join("outside");
        write_random_file(&env.local("new.txt"), 100, 14);
        make_small_tree(&env.local("tree"), 15);

        let remote = env.remote("out_dir/new.txt");
        let out = env.rcp(rcp_args![env.local("new.txt"), remote]);
        out.assert_code(4)
            .assert_error_line(&remote, SYMLINK_ESCAPE_WORDS);
        let out = env.rcp(rcp_args![env.local("new.txt"), env.remote("out_dir/")]);
        out.assert_code(4)
            .assert_stderr_has_any(SYMLINK_ESCAPE_WORDS)
            .assert_stderr_has("out_dir");
        let out = env.rcp(rcp_args![
            "-r",
            env.local("tree"),
            env.remote("out_dir/sub")
        ]);
        out.assert_code(4)
            .assert_stderr_has_any(SYMLINK_ESCAPE_WORDS)
            .assert_stderr_has("out_dir/sub");

        // Replacing the link itself is the server's call, but the target must not change.
        env.rcp(rcp_args![env.local("new.txt"), env.remote("out_file")]);
        env.rcp(rcp_args![env.local("new.txt"), env.remote("rel_out")]);

        assert_entries(&outside, &["secret.txt"]);
        assert_eq!(fs::read(outside.join("secret.txt")).unwrap(), secret);
        assert_entries(env.root(), &["local", "shares", "outside"]);
        assert_no_temp_files(&env.share(""));
    }
);

ferrytest!(upload_into_missing_remote_dir_fails_cleanly, |env| {
    write_random_file(&env.local("f.bin"), 3 * MIB, 16);
    fs::create_dir(env.share("dir")).unwrap();
    let remote = env.remote("nodir/sub/f.bin");
    let out = env.rcp(rcp_args![env.local("f.bin"), remote]);
    out.assert_code(4)
        .assert_error_line(&remote, NOT_FOUND_WORDS);
    assert_entries(&env.share(""), &["dir"]);
    assert_no_temp_files(&env.share(""));
});
