//! Disks (issue 6, point 5): a full destination file system and files that cannot be
//! read or written.
//!
//! - Full: the share, or rcp's local destination, is a small tmpfs mounted for the test
//!   (unmounted by a drop guard, also when the test fails). A file that does not fit
//!   fails with "no space" naming its path (exit 4 on the server, 5 locally), nothing
//!   of it is left (no temporary file, nothing under the final name, the space is
//!   free again), the other files of a tree arrive whole, and ferryd goes on serving.
//! - Permissions: the suite runs as root, which reads anything, so the program under
//!   test runs as `nobody` ([`User::unprivileged`]): rcp reading a tree with an
//!   unreadable file and directory, ferryd serving one, and each writing into a
//!   directory it may not write. Every such item is reported with its path, the rest
//!   of the tree is copied, and the exit code is nonzero.
//!
//! A test that cannot run here (not root, no tmpfs) says why on stderr and passes.

use std::fs;
use std::os::unix::fs::symlink;

use serde_json::Value;

use ferry_tests::{
    assert_entries, assert_files_equal, assert_no_temp_files, rcp_args, set_mode,
    write_random_file, Env, RcpOutput, Tmpfs, User, DEFAULT_SHARE, MIB,
};

/// Size of every tmpfs the tests mount.
const TMPFS_BYTES: u64 = 8 * MIB;

/// Words a "no space" error must use.
const NO_SPACE: &[&str] = &["no space"];

/// Words a permission error must use.
const DENIED: &[&str] = &["permission denied"];

/// True if a tmpfs can be mounted; else prints why `test` is skipped.
fn tmpfs_or_skip(test: &str) -> bool {
    match Tmpfs::available() {
        Ok(()) => true,
        Err(why) => {
            eprintln!("{test}: skipped: {why}");
            false
        }
    }
}

/// The unprivileged user, or `None` after printing why `test` is skipped.
fn user_or_skip(test: &str) -> Option<User> {
    match User::unprivileged() {
        Ok(user) => Some(user),
        Err(why) => {
            eprintln!("{test}: skipped: {why}");
            None
        }
    }
}

/// The `--json` summary's `errors`, as `(path, kind)` pairs sorted by path.
fn json_errors(out: &RcpOutput) -> Vec<(String, String)> {
    let v = out.json();
    assert_eq!(
        v["exit_code"].as_i64(),
        out.code.map(i64::from),
        "exit_code in {v}"
    );
    let mut errors: Vec<(String, String)> = v["errors"]
        .as_array()
        .unwrap_or_else(|| panic!("no errors array in {v}"))
        .iter()
        .map(|e: &Value| {
            let field = |k: &str| {
                e[k].as_str()
                    .unwrap_or_else(|| panic!("error entry without {k}: {v}"))
                    .to_owned()
            };
            assert!(!field("message").is_empty(), "empty message: {v}");
            (field("path"), field("kind"))
        })
        .collect();
    errors.sort();
    errors
}

/// `(path, kind)` pairs, sorted, for comparing with [`json_errors`].
fn expected(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
    let mut v: Vec<(String, String)> = pairs
        .iter()
        .map(|(p, k)| ((*p).to_owned(), (*k).to_owned()))
        .collect();
    v.sort();
    v
}

/// Checks ferryd still serves after a failure: a small upload and its download.
fn assert_still_serving(env: &Env, probe: &str) {
    env.server().assert_running();
    let src = env.local(&format!("{probe}.up"));
    write_random_file(&src, MIB + 17, 99);
    env.rcp(rcp_args![src, env.remote(probe)]).assert_success();
    let back = env.local(&format!("{probe}.back"));
    env.rcp(rcp_args![env.remote(probe), back]).assert_success();
    assert_files_equal(&src, &back);
}

/// A local tree for the full-disk tests: three files that fit in a [`TMPFS_BYTES`]
/// tmpfs together, a symlink, and `sub/huge.bin`, larger than the whole file system.
fn make_tree_with_a_huge_file(root: &std::path::Path) {
    fs::create_dir_all(root.join("sub")).unwrap();
    write_random_file(&root.join("a.bin"), MIB + 3, 1);
    write_random_file(&root.join("c.txt"), 100, 2);
    write_random_file(&root.join("sub/b.bin"), 2 * MIB, 3);
    write_random_file(&root.join("sub/huge.bin"), TMPFS_BYTES + 4 * MIB, 4);
    symlink("a.bin", root.join("link")).unwrap();
}

/// Checks that a copy of [`make_tree_with_a_huge_file`] holds everything but the huge
/// file.
fn assert_copied_all_but_the_huge_file(src: &std::path::Path, dst: &std::path::Path) {
    assert_entries(dst, &["a.bin", "c.txt", "link", "sub"]);
    assert_entries(&dst.join("sub"), &["b.bin"]);
    for f in ["a.bin", "c.txt", "sub/b.bin"] {
        assert_files_equal(&src.join(f), &dst.join(f));
    }
    assert_eq!(
        fs::read_link(dst.join("link")).unwrap(),
        std::path::Path::new("a.bin")
    );
}

#[test]
fn upload_bigger_than_the_free_space_says_no_space_and_leaves_nothing() {
    if !tmpfs_or_skip("upload_bigger_than_the_free_space_says_no_space_and_leaves_nothing") {
        return;
    }
    let env = Env::builder().tmpfs(DEFAULT_SHARE, TMPFS_BYTES).start();
    // 5 MiB used: a 4 MiB file would fit the file system but not its free space.
    write_random_file(&env.share("filler.bin"), 5 * MIB, 5);
    let free = env.tmpfs(DEFAULT_SHARE).free_bytes();
    let big = env.local("big.bin");
    write_random_file(&big, 4 * MIB, 6);
    assert!(free < 4 * MIB, "the tmpfs has {free} bytes free");

    let remote = env.remote("big.bin");
    let out = env.rcp(rcp_args!["--json", big, remote]);
    out.assert_code(4).assert_error_line(&remote, NO_SPACE);
    assert_eq!(json_errors(&out), expected(&[(&remote, "no_space")]));
    assert_entries(&env.share(""), &["filler.bin"]);
    assert_eq!(
        env.tmpfs(DEFAULT_SHARE).free_bytes(),
        free,
        "the failed upload kept space"
    );

    // The same into a directory, and a file larger than the whole file system.
    write_random_file(&env.local("huge.bin"), 2 * TMPFS_BYTES, 7);
    let out = env.rcp(rcp_args![env.local("huge.bin"), env.remote("")]);
    out.assert_code(4)
        .assert_error_line(env.remote("huge.bin"), NO_SPACE);
    assert_entries(&env.share(""), &["filler.bin"]);
    assert_no_temp_files(&env.share(""));

    // A file of several windows, whose space ferryd reserves beside its first windows
    // rather than before answering, fails the same way, having written nothing.
    write_random_file(&env.local("windows.bin"), 40 * MIB + 5, 12);
    let remote = env.remote("windows.bin");
    let out = env.rcp(rcp_args!["--json", env.local("windows.bin"), &remote]);
    out.assert_code(4).assert_error_line(&remote, NO_SPACE);
    assert_eq!(json_errors(&out), expected(&[(&remote, "no_space")]));
    assert_entries(&env.share(""), &["filler.bin"]);
    assert_no_temp_files(&env.share(""));
    assert_eq!(
        env.tmpfs(DEFAULT_SHARE).free_bytes(),
        free,
        "the failed upload kept space"
    );

    assert_still_serving(&env, "after.bin");
    let back = env.local("filler.back");
    env.rcp(rcp_args![env.remote("filler.bin"), back])
        .assert_success();
    assert_files_equal(&env.share("filler.bin"), &back);
}

#[test]
fn tree_upload_onto_a_full_disk_copies_everything_that_fits() {
    if !tmpfs_or_skip("tree_upload_onto_a_full_disk_copies_everything_that_fits") {
        return;
    }
    let env = Env::builder().tmpfs(DEFAULT_SHARE, TMPFS_BYTES).start();
    let src = env.local("tree");
    make_tree_with_a_huge_file(&src);

    let huge = env.remote("t/sub/huge.bin");
    let out = env.rcp(rcp_args!["--json", "-r", src, env.remote("t")]);
    out.assert_code(4).assert_error_line(&huge, NO_SPACE);
    assert_eq!(json_errors(&out), expected(&[(&huge, "no_space")]));
    assert_eq!(out.json()["files"], 3, "{out}");
    assert_copied_all_but_the_huge_file(&src, &env.share("t"));
    assert_no_temp_files(&env.share(""));
    assert_still_serving(&env, "after.bin");
}

/// Downloads the share's `name` into `small` (holding only `filler.bin`, `free` bytes
/// free), which it does not fit: exit 5 and "no space" naming it, `no_space` in the
/// JSON, nothing of it left and the space free again.
fn assert_download_finds_no_space(env: &Env, name: &str, small: &Tmpfs, free: u64) {
    let dest = small.path().join(name);
    let out = env.rcp(rcp_args!["--json", env.remote(name), small.path()]);
    out.assert_code(5).assert_error_line(&dest, NO_SPACE);
    assert_eq!(
        json_errors(&out),
        expected(&[(&dest.display().to_string(), "no_space")])
    );
    assert_entries(small.path(), &["filler.bin"]);
    assert_eq!(small.free_bytes(), free, "the failed download kept space");
}

#[test]
fn download_bigger_than_the_free_space_says_no_space_and_leaves_nothing() {
    if !tmpfs_or_skip("download_bigger_than_the_free_space_says_no_space_and_leaves_nothing") {
        return;
    }
    let env = Env::new();
    write_random_file(&env.share("big.bin"), 4 * MIB, 8);
    // Declared after `env`: unmounted before the temp dir goes, even on a panic.
    let small = Tmpfs::mount(&env.local("small"), TMPFS_BYTES).unwrap();
    write_random_file(&small.path().join("filler.bin"), 5 * MIB, 9);
    let free = small.free_bytes();
    assert!(free < 4 * MIB, "the tmpfs has {free} bytes free");

    assert_download_finds_no_space(&env, "big.bin", &small, free);

    // Under a new name, and a file larger than the whole file system.
    write_random_file(&env.share("huge.bin"), 2 * TMPFS_BYTES, 10);
    let dest = small.path().join("renamed.bin");
    let out = env.rcp(rcp_args![env.remote("huge.bin"), dest]);
    out.assert_code(5).assert_error_line(&dest, NO_SPACE);
    assert_entries(small.path(), &["filler.bin"]);

    // A file of several windows, whose space rcp reserves beside its first windows
    // rather than before them, fails the same way, having written nothing.
    write_random_file(&env.share("windows.bin"), 40 * MIB + 5, 11);
    assert_download_finds_no_space(&env, "windows.bin", &small, free);

    assert_still_serving(&env, "after.bin");
}

#[test]
fn tree_download_onto_a_full_disk_copies_everything_that_fits() {
    if !tmpfs_or_skip("tree_download_onto_a_full_disk_copies_everything_that_fits") {
        return;
    }
    let env = Env::new();
    make_tree_with_a_huge_file(&env.share("t"));
    let small = Tmpfs::mount(&env.local("small"), TMPFS_BYTES).unwrap();

    let dst = small.path().join("t");
    let huge = dst.join("sub/huge.bin");
    let out = env.rcp(rcp_args!["--json", "-r", env.remote("t"), dst]);
    out.assert_code(5).assert_error_line(&huge, NO_SPACE);
    assert_eq!(
        json_errors(&out),
        expected(&[(&huge.display().to_string(), "no_space")])
    );
    assert_copied_all_but_the_huge_file(&env.share("t"), &dst);
    assert_no_temp_files(small.path());
    assert_still_serving(&env, "after.bin");
}

/// Builds, as root, a tree `root` readable by everyone except `secret.bin` (mode 000)
/// and the directory `locked` (mode 000, holding a file): `ok.bin`, `sub/fine.txt`,
/// `sub/link`.
fn make_tree_with_unreadable_parts(root: &std::path::Path) {
    fs::create_dir_all(root.join("sub")).unwrap();
    fs::create_dir(root.join("locked")).unwrap();
    write_random_file(&root.join("ok.bin"), MIB + 5, 12);
    write_random_file(&root.join("secret.bin"), 1000, 13);
    write_random_file(&root.join("sub/fine.txt"), 10, 14);
    write_random_file(&root.join("locked/inside.txt"), 10, 15);
    symlink("fine.txt", root.join("sub/link")).unwrap();
    for f in ["ok.bin", "sub/fine.txt"] {
        set_mode(&root.join(f), 0o644);
    }
    set_mode(&root.join("secret.bin"), 0o000);
    set_mode(&root.join("locked"), 0o000);
    for d in ["", "sub"] {
        set_mode(&root.join(d), 0o755);
    }
}

/// Checks that a copy of [`make_tree_with_unreadable_parts`] holds exactly its readable
/// part (an unreadable directory is not created).
fn assert_copied_the_readable_part(src: &std::path::Path, dst: &std::path::Path) {
    assert_entries(dst, &["ok.bin", "sub"]);
    assert_entries(&dst.join("sub"), &["fine.txt", "link"]);
    assert_files_equal(&src.join("ok.bin"), &dst.join("ok.bin"));
    assert_files_equal(&src.join("sub/fine.txt"), &dst.join("sub/fine.txt"));
}

#[test]
fn tree_upload_reports_unreadable_files_and_dirs_and_copies_the_rest() {
    let Some(user) =
        user_or_skip("tree_upload_reports_unreadable_files_and_dirs_and_copies_the_rest")
    else {
        return;
    };
    let env = Env::builder().rcp_user(user).start();
    let src = env.local("tree");
    make_tree_with_unreadable_parts(&src);
    let (secret, locked) = (src.join("secret.bin"), src.join("locked"));

    let out = env.rcp(rcp_args!["--json", "-r", src, env.remote("t")]);
    out.assert_code(5)
        .assert_error_line(&secret, DENIED)
        .assert_error_line(&locked, DENIED);
    assert_eq!(
        json_errors(&out),
        expected(&[
            (&secret.display().to_string(), "permission_denied"),
            (&locked.display().to_string(), "permission_denied"),
        ])
    );
    assert_copied_the_readable_part(&src, &env.share("t"));
    assert_no_temp_files(&env.share(""));

    // An unreadable file named on the command line, next to a readable one.
    let out = env.rcp(rcp_args![
        "--json",
        secret,
        src.join("ok.bin"),
        env.remote("t/sub/")
    ]);
    out.assert_code(5).assert_error_line(&secret, DENIED);
    assert_eq!(
        json_errors(&out),
        expected(&[(&secret.display().to_string(), "permission_denied")])
    );
    assert_entries(&env.share("t/sub"), &["fine.txt", "link", "ok.bin"]);
    env.server().assert_running();
}

#[test]
fn tree_download_reports_files_the_server_cannot_read_and_copies_the_rest() {
    let Some(user) =
        user_or_skip("tree_download_reports_files_the_server_cannot_read_and_copies_the_rest")
    else {
        return;
    };
    let env = Env::builder().server_user(user).start();
    make_tree_with_unreadable_parts(&env.share("t"));
    let (secret, locked) = (env.remote("t/secret.bin"), env.remote("t/locked"));

    let dst = env.local("t");
    let out = env.rcp(rcp_args!["--json", "-r", env.remote("t"), dst]);
    out.assert_code(4)
        .assert_error_line(&secret, DENIED)
        .assert_error_line(&locked, DENIED);
    assert_eq!(
        json_errors(&out),
        expected(&[
            (&secret, "permission_denied"),
            (&locked, "permission_denied")
        ])
    );
    assert_copied_the_readable_part(&env.share("t"), &dst);
    assert_no_temp_files(&env.local(""));

    // A single unreadable file.
    let out = env.rcp(rcp_args![&secret, env.local("one.bin")]);
    out.assert_code(4).assert_error_line(&secret, DENIED);
    assert!(!env.local("one.bin").exists());
    assert_still_serving(&env, "after.bin");
}

#[test]
fn tree_upload_into_a_server_dir_it_cannot_write_copies_the_rest() {
    let Some(user) = user_or_skip("tree_upload_into_a_server_dir_it_cannot_write_copies_the_rest")
    else {
        return;
    };
    let env = Env::builder().server_user(user).start();
    // The target tree exists; ferryd (nobody) may write `t` but not root's `t/sub`.
    fs::create_dir_all(env.share("t/sub")).unwrap();
    user.own(&env.share("t"));
    let src = env.local("t");
    fs::create_dir_all(src.join("sub")).unwrap();
    write_random_file(&src.join("top.bin"), MIB + 1, 16);
    write_random_file(&src.join("sub/denied.bin"), 100, 17);

    let out = env.rcp(rcp_args!["--json", "-r", src, env.remote("")]);
    out.assert_code(4)
        .assert_error_line(env.remote("t/sub/denied.bin"), DENIED);
    let errors = json_errors(&out);
    assert!(
        errors.iter().all(|(_, kind)| kind == "permission_denied"),
        "{errors:?}"
    );
    assert_entries(&env.share("t"), &["sub", "top.bin"]);
    assert_entries(&env.share("t/sub"), &[]);
    assert_files_equal(&src.join("top.bin"), &env.share("t/top.bin"));
    assert_no_temp_files(&env.share(""));
    env.server().assert_running();
}

#[test]
fn tree_download_into_a_local_dir_it_cannot_write_copies_the_rest() {
    let Some(user) = user_or_skip("tree_download_into_a_local_dir_it_cannot_write_copies_the_rest")
    else {
        return;
    };
    let env = Env::builder().rcp_user(user).start();
    fs::create_dir_all(env.share("t/sub")).unwrap();
    write_random_file(&env.share("t/top.bin"), MIB + 1, 18);
    write_random_file(&env.share("t/sub/denied.bin"), 100, 19);
    // rcp (nobody) may write `local/t` but not root's `local/t/sub`.
    let dst = env.local("t");
    fs::create_dir_all(dst.join("sub")).unwrap();
    user.own(&dst);

    let out = env.rcp(rcp_args!["--json", "-r", env.remote("t"), env.local("")]);
    out.assert_code(5)
        .assert_error_line(dst.join("sub"), &["not permitted", "permission denied"]);
    assert_eq!(
        json_errors(&out),
        expected(&[(&dst.join("sub").display().to_string(), "permission_denied")])
    );
    assert_entries(&dst, &["sub", "top.bin"]);
    assert_entries(&dst.join("sub"), &[]);
    assert_files_equal(&env.share("t/top.bin"), &dst.join("top.bin"));
    assert_no_temp_files(&env.local(""));
}
