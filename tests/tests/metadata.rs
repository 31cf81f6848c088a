//! What `rcp -r` keeps of a tree, like `rsync -a --numeric-ids` (issue 20): file
//! contents, sizes, modes (set-user-ID included) and nanosecond mtimes of files,
//! directories and symlinks (a symlink's own mtime), symlink targets, and, when the
//! receiving side runs as root, numeric owners and groups of every entry. The tree goes
//! up to ferryd and comes back to a fresh directory; each copy is compared with the
//! source entry by entry.

use std::fs;
use std::os::unix::fs::{lchown, symlink};
use std::path::Path;
use std::sync::Arc;

use ferry_client::copy::{upload, CopyOptions};
use ferry_client::location::Remote;
use ferry_client::progress::Progress;
use ferry_client::Client;
use ferry_tests::{
    assert_no_temp_files, assert_trees_identical, credentials, ferrytest, make_small_tree,
    rcp_args, runtime, set_mode, test_choice, write_random_file, Env, User, DEFAULT_SHARE, MIB,
};
use nix::sys::stat::{utimensat, UtimensatFlags};
use nix::sys::time::TimeSpec;

/// Sets the own mtime of `path` (a symlink's, not its target's) to `secs.nanos`.
fn set_mtime_ns(path: &Path, secs: i64, nanos: i64) {
    let t = TimeSpec::new(secs, nanos);
    utimensat(None, path, &t, &t, UtimensatFlags::NoFollowSymlink)
        .unwrap_or_else(|e| panic!("utimensat {}: {e}", path.display()));
}

fn is_root() -> bool {
    nix::unistd::geteuid().is_root()
}

/// A mixed tree under `root`: small files (batched) and large ones (per file), a
/// set-user-ID file, an empty directory, symlinks to a file, to a directory, dangling
/// and absolute, each with an mtime of its own to the nanosecond; as root, entries owned
/// by several numeric users and groups, a symlink among them. Directory mtimes are set
/// last, deepest first.
fn make_mixed_tree(root: &Path) {
    make_small_tree(root, 20);
    fs::create_dir(root.join("sub/more")).unwrap();
    write_random_file(&root.join("sub/more/large.bin"), 2 * MIB + 7, 21);
    fs::write(root.join("sub/more/small.txt"), b"small").unwrap();
    fs::write(root.join("setuid"), b"#!/bin/sh\n").unwrap();
    set_mode(&root.join("setuid"), 0o4755);
    symlink("../a.txt", root.join("sub/link_up")).unwrap();
    symlink("sub", root.join("link_dir")).unwrap();
    symlink("no/such/target", root.join("sub/more/dangling")).unwrap();
    symlink("/etc/hostname", root.join("abs")).unwrap();
    let files = [
        "a.txt",
        "sub/b.bin",
        "sub/deeper/c.empty",
        "sub/more/large.bin",
        "sub/more/small.txt",
        "setuid",
    ];
    let links = [
        "link",
        "sub/link_up",
        "link_dir",
        "sub/more/dangling",
        "abs",
    ];
    if is_root() {
        let owners: [(&str, u32, u32); 8] = [
            ("a.txt", 1234, 2345),
            ("sub/b.bin", 0, 0),
            ("sub/more/small.txt", 65534, 100),
            ("sub/more/large.bin", 1234, 2345),
            ("setuid", 1234, 2345),
            ("link", 4321, 5432),
            ("sub/more/dangling", 65534, 100),
            ("sub/deeper", 777, 888),
        ];
        for (rel, uid, gid) in owners {
            lchown(root.join(rel), Some(uid), Some(gid)).unwrap();
        }
        // chown cleared the set-user-ID bit.
        set_mode(&root.join("setuid"), 0o4755);
    }
    for (i, rel) in files.iter().chain(&links).enumerate() {
        set_mtime_ns(
            &root.join(rel),
            1_400_000_000 + i as i64 * 977,
            123_456_789 + i as i64,
        );
    }
    let dirs = ["sub/more", "sub/deeper", "sub", "empty", ""];
    for (i, rel) in dirs.iter().enumerate() {
        set_mtime_ns(
            &root.join(rel),
            1_450_000_000 + i as i64 * 3_600,
            987_654_321 - i as i64,
        );
    }
}

ferrytest!(
    metadata_round_trip_keeps_mtimes_symlink_mtimes_modes_and_owners,
    |env| {
        let src = env.local("src");
        make_mixed_tree(&src);
        let owners = is_root();
        env.rcp(rcp_args!["-r", src, env.remote("dst")])
            .assert_success();
        assert_no_temp_files(&env.share(""));
        assert_trees_identical(&src, &env.share("dst"), owners);

        let back = env.local("back");
        env.rcp(rcp_args!["-r", env.remote("dst"), back])
            .assert_success();
        assert_no_temp_files(&env.local(""));
        assert_trees_identical(&src, &back, owners);
    }
);

ferrytest!(
    metadata_a_second_copy_over_the_first_keeps_them_too,
    |env| {
        let src = env.local("src");
        make_mixed_tree(&src);
        // Twice into the same directory: the second copy replaces every file and symlink
        // and reuses every directory.
        for _ in 0..2 {
            env.rcp(rcp_args!["-r", src, env.remote("")])
                .assert_success();
        }
        assert_trees_identical(&src, &env.share("src"), is_root());
        let back = env.local("back");
        fs::create_dir(&back).unwrap();
        for _ in 0..2 {
            env.rcp(rcp_args!["-r", env.remote("src"), back])
                .assert_success();
        }
        assert_trees_identical(&src, &back.join("src"), is_root());
    }
);

/// A progress that ignores everything.
struct Quiet;

impl Progress for Quiet {
    fn set_total(&self, _bytes: u64) {}
    fn advance(&self, _bytes: u64) {}
}

ferrytest!(
    metadata_a_client_without_directory_batches_keeps_them_too,
    |env| {
        // The path every server before the directory batches gets: one `Mkdir` and one
        // `SetAttr` per directory, the directories' owners in `SetMeta`.
        let src = env.local("src");
        make_mixed_tree(&src);
        let (host, port) = env.server().addr().rsplit_once(':').unwrap();
        let dest = Remote {
            host: host.into(),
            port: port.parse().unwrap(),
            share: DEFAULT_SHARE.into(),
            path: "dst".into(),
            dir_hint: false,
        };
        let opts = CopyOptions {
            recursive: true,
            jobs: 4,
            hard_links: false,
            xattrs: false,
        };
        let report = runtime().block_on(async {
            let credentials = credentials().without_dir_batches();
            let client = Client::connect_with(host, dest.port, test_choice(), credentials)
                .await
                .unwrap();
            assert!(client.has_meta() && !client.has_dirs());
            upload(
                &client,
                std::slice::from_ref(&src),
                &dest,
                &opts,
                Arc::new(Quiet),
            )
            .await
        });
        assert!(report.errors.is_empty(), "{:?}", report.errors);
        assert_eq!(report.dirs, 5);
        assert_no_temp_files(&env.share(""));
        assert_trees_identical(&src, &env.share("dst"), is_root());
    }
);

/// A ferryd that does not run as root keeps its own ids, as rsync does, and says
/// nothing of it; symlink mtimes are kept all the same.
#[test]
fn metadata_a_server_not_running_as_root_ignores_owners() {
    let user = match User::unprivileged() {
        Ok(u) => u,
        Err(why) => {
            eprintln!("metadata_a_server_not_running_as_root_ignores_owners: skipped: {why}");
            return;
        }
    };
    let env = Env::builder().server_user(user).start();
    let src = env.local("src");
    make_mixed_tree(&src);
    // A directory whose mode shuts its owner out, with a directory inside: ferryd, not
    // root, must set the inner one's attributes before the outer one's.
    fs::create_dir_all(src.join("locked/inner")).unwrap();
    fs::write(src.join("locked/inner/f"), b"f").unwrap();
    set_mode(&src.join("locked/inner"), 0o750);
    set_mode(&src.join("locked"), 0o600);
    set_mtime_ns(&src.join("locked/inner"), 1_300_000_000, 1);
    set_mtime_ns(&src.join("locked"), 1_300_000_000, 2);
    set_mtime_ns(&src, 1_300_000_000, 3);
    env.rcp(rcp_args!["-r", src, env.remote("dst")])
        .assert_success();
    assert_trees_identical(&src, &env.share("dst"), false);
    use std::os::unix::fs::MetadataExt;
    for rel in ["dst", "dst/a.txt", "dst/link", "dst/sub/deeper"] {
        let m = fs::symlink_metadata(env.share(rel)).unwrap();
        assert_eq!((m.uid(), m.gid()), (user.uid, user.gid), "{rel}");
    }
}

/// (device, inode) of `path`, not following a symlink.
fn inode(path: &Path) -> (u64, u64) {
    use std::os::unix::fs::MetadataExt;
    let m = fs::symlink_metadata(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    (m.dev(), m.ino())
}

/// Asserts which names of `root` share an inode: each group in `linked` one inode of
/// its own, and `alone` a name no other holds.
fn assert_links(root: &Path, linked: &[&[&str]], alone: &str) {
    use std::os::unix::fs::MetadataExt;
    for group in linked {
        let first = inode(&root.join(group[0]));
        for name in &group[1..] {
            assert_eq!(inode(&root.join(name)), first, "{}: {name}", root.display());
        }
    }
    assert_ne!(
        inode(&root.join(linked[0][0])),
        inode(&root.join(linked[1][0]))
    );
    let m = fs::metadata(root.join(alone)).unwrap();
    assert_eq!(m.nlink(), 1, "{alone}");
}

ferrytest!(hard_links_inside_a_tree_are_kept_with_dash_h, |env| {
    let src = env.local("src");
    fs::create_dir_all(src.join("sub/deep")).unwrap();
    // One large file (the per-file path) and one small (a batch), each with two more
    // names, and a file with one name.
    write_random_file(&src.join("large.bin"), 2 * MIB + 3, 31);
    fs::hard_link(src.join("large.bin"), src.join("sub/large-again.bin")).unwrap();
    fs::hard_link(src.join("large.bin"), src.join("sub/deep/large-3")).unwrap();
    fs::write(src.join("sub/small.txt"), b"small and linked").unwrap();
    fs::hard_link(src.join("sub/small.txt"), src.join("small-again.txt")).unwrap();
    fs::hard_link(src.join("sub/small.txt"), src.join("sub/deep/small-3")).unwrap();
    fs::write(src.join("alone.txt"), b"one name").unwrap();
    let linked: [&[&str]; 2] = [
        &["large.bin", "sub/large-again.bin", "sub/deep/large-3"],
        &["sub/small.txt", "small-again.txt", "sub/deep/small-3"],
    ];

    let out = env.rcp(rcp_args!["-r", "-H", "--json", &src, env.remote("dst")]);
    out.assert_success();
    let summary: serde_json::Value = serde_json::from_str(&out.stdout).unwrap();
    assert_eq!(summary["hard_links"], 4, "{}", out.stdout);
    assert_eq!(summary["files"], 3, "{}", out.stdout);
    assert_links(&env.share("dst"), &linked, "alone.txt");
    assert_trees_identical(&src, &env.share("dst"), is_root());
    // Again over the first copy: the further names are replaced, still links.
    env.rcp(rcp_args!["-r", "-H", &src, env.remote("")])
        .assert_success();
    env.rcp(rcp_args!["-r", "-H", &src, env.remote("")])
        .assert_success();
    assert_links(&env.share("src"), &linked, "alone.txt");
    assert_no_temp_files(&env.share(""));

    // Down, with -H twice into the same place, and without it.
    let back = env.local("back");
    fs::create_dir(&back).unwrap();
    for _ in 0..2 {
        env.rcp(rcp_args!["-r", "-H", env.remote("dst"), &back])
            .assert_success();
    }
    assert_links(&back.join("dst"), &linked, "alone.txt");
    assert_trees_identical(&src, &back.join("dst"), is_root());
    assert_no_temp_files(&back);
    let plain = env.local("plain");
    env.rcp(rcp_args!["-r", env.remote("dst"), &plain])
        .assert_success();
    assert_trees_identical(&src, &plain, is_root());
    for group in linked {
        for name in group {
            use std::os::unix::fs::MetadataExt;
            assert_eq!(fs::metadata(plain.join(name)).unwrap().nlink(), 1, "{name}");
        }
    }
});
