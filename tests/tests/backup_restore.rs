//! Restoring from snapshots made by `rcp backup` through the FUSE mount: a snapshot is
//! a plain browsable tree, so `ferry-mount` shows every snapshot as it was taken, the
//! hard-linked files of older snapshots included.

use std::fs;
use std::os::unix::fs::MetadataExt;
use std::time::Duration;

use ferry_tests::{
    assert_trees_equal, ferrytest, make_small_tree, rcp_args, write_random_file, Mount, MIB,
};

/// Runs `rcp backup --json SRC DEST` and returns the new snapshot's share-relative path.
fn backup(env: &ferry_tests::Env, src: &std::path::Path, dest: &str) -> String {
    let out = env.rcp(rcp_args!["backup", "--json", src, dest]);
    out.assert_success();
    let json = out.json();
    json["targets"][0]["snapshot"]
        .as_str()
        .unwrap_or_else(|| panic!("no snapshot in {json}"))
        .to_string()
}

ferrytest!(every_snapshot_reads_back_through_the_mount, |env| {
    let src = env.local("src");
    make_small_tree(&src, 11);
    write_random_file(&src.join("sub/big.bin"), 3 * MIB + 17, 12);
    let dest = env.remote("backups/host");
    let first = backup(&env, &src, &dest);
    // Keep what the first snapshot must hold: the share's copy, which later runs link
    // to and must never change.
    let kept = env.local("first");
    let out = env.rcp(rcp_args!["-r", env.remote(&first), &kept]);
    out.assert_success();
    assert_trees_equal(&src, &kept);

    // Change one file by a few bytes, add one, delete one; snapshot names have second
    // resolution.
    let big = src.join("sub/big.bin");
    let mut bytes = fs::read(&big).unwrap();
    bytes[MIB as usize + 3] ^= 0x5a;
    fs::write(&big, &bytes).unwrap();
    fs::write(src.join("new.txt"), b"added after the first snapshot\n").unwrap();
    fs::remove_file(src.join("a.txt")).unwrap();
    fs::remove_file(src.join("link")).unwrap();
    std::thread::sleep(Duration::from_millis(1100));
    let second = backup(&env, &src, &dest);
    assert_ne!(first, second);

    let mount = Mount::start(env.remote(""));
    assert_trees_equal(&src, &mount.join(&second));
    assert_trees_equal(&kept, &mount.join(&first));
    // The unchanged file is one inode in both snapshots, and the mount shows it so.
    let a = fs::metadata(mount.join(&format!("{first}/sub/b.bin"))).unwrap();
    let b = fs::metadata(mount.join(&format!("{second}/sub/b.bin"))).unwrap();
    assert_eq!(a.ino(), b.ino());
    assert_eq!(b.nlink(), 2);
    // No partial snapshot is left to confuse a restore.
    let names: Vec<String> = fs::read_dir(mount.join("backups/host"))
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    assert!(
        names.iter().all(|n| !n.starts_with('.')),
        "hidden entries after two complete backups: {names:?}"
    );
    assert_eq!(names.len(), 2, "{names:?}");
    mount.unmount();
});
