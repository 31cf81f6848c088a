//! `ferry-mount cluster://ETCD/SHARE`: the FUSE mount of a cluster share striped and
//! replicated over nodes in network namespaces (the [`Cluster`] harness): names,
//! attributes and bytes as written, reads across stripe boundaries, a damaged replica
//! and a killed node passed over with no error, EROFS for changes with `-o ro`; and
//! writes (close-to-open, whole files) and namespace changes through a read-write
//! mount, read back with `rcp`.
//!
//! Needs root, etcd and FUSE (skipped otherwise, with the reason).

use std::fs::{self, File};
use std::io::Read;
use std::os::unix::fs::{FileExt, MetadataExt, PermissionsExt};
use std::path::Path;
use std::time::{Duration, Instant, UNIX_EPOCH};

use ferry_cluster::model::Layout;
use ferry_tests::{
    assert_trees_equal, ferry_mount, rcp, rcp_args, skip_without_cluster, skip_without_fuse,
    write_random_file, Cluster, Mount, MIB,
};
use rand::{Rng, SeedableRng};

/// How long one whole read of the test file through the mount may take, a node's
/// failure included.
const READ_LIMIT: Duration = Duration::from_secs(30);

/// The layout of file `path` of share `data`, from etcd.
fn layout_of(cluster: &Cluster, path: &str) -> Layout {
    cluster.layout_of("data", path)
}

/// Node number `k` of node id `nK`.
fn node_number(id: &str) -> usize {
    id.strip_prefix('n')
        .and_then(|k| k.parse().ok())
        .unwrap_or_else(|| panic!("node id {id}"))
}

/// Empties the kernel's page cache, so reads through the mount reach ferry-mount.
fn drop_caches() {
    fs::write("/proc/sys/vm/drop_caches", "3").expect("drop the page cache (root)");
}

/// The errno of `r`'s error; panics if it succeeded.
#[track_caller]
fn errno_of<T: std::fmt::Debug>(r: std::io::Result<T>) -> i32 {
    r.expect_err("a change through a read-only mount")
        .raw_os_error()
        .expect("an OS error")
}

/// Reads `len` bytes at `offset` of `file` with pread, as many calls as it takes.
fn pread(file: &File, offset: u64, len: usize) -> Vec<u8> {
    let mut buf = vec![0; len];
    file.read_exact_at(&mut buf, offset)
        .unwrap_or_else(|e| panic!("pread {len} at {offset}: {e}"));
    buf
}

#[test]
fn a_cluster_share_mounts_read_only_and_reads_around_bad_replicas_and_lost_nodes() {
    let name = "a_cluster_share_mounts_read_only_and_reads_around_bad_replicas_and_lost_nodes";
    if skip_without_cluster(name) || skip_without_fuse(name) {
        return;
    }
    let mut cluster = Cluster::start_with_share(3, "data", 2, 1);
    let tree = cluster.dir().join("local/tree");
    fs::create_dir_all(tree.join("a/b")).unwrap();
    let size = 7 * MIB + 123;
    write_random_file(&tree.join("big"), size, 1);
    fs::set_permissions(tree.join("big"), fs::Permissions::from_mode(0o640)).unwrap();
    File::open(tree.join("big"))
        .unwrap()
        .set_modified(UNIX_EPOCH + Duration::new(1_500_000_000, 123_456_789))
        .unwrap();
    write_random_file(&tree.join("a/small"), 4000, 2);
    write_random_file(&tree.join("a/b/empty"), 0, 3);
    std::os::unix::fs::symlink("../big", tree.join("a/link")).unwrap();
    rcp(rcp_args!["-r", &tree, cluster.url("data", "")]).assert_success();
    let want = fs::read(tree.join("big")).unwrap();

    // Damage stripe 1's first replica on its node: the mount must pass it over.
    let layout = layout_of(&cluster, "tree/big");
    assert_eq!(layout.stripes.len(), 8);
    let bad_node = node_number(&layout.stripes[1].replicas[0]);
    let object = cluster
        .node_store(bad_node)
        .join(layout.object_path("data", 1));
    let mut bytes = fs::read(&object).unwrap();
    bytes[MIB as usize / 2] ^= 0x40;
    fs::write(&object, &bytes).unwrap();

    let mount = Mount::builder(cluster.url("data", ""))
        .opt("cache_size=2,ro")
        .start();

    // Names, kinds, modes, mtimes and bytes, as written.
    assert_trees_equal(&tree, &mount.join("tree"));
    let md = fs::metadata(mount.join("tree/big")).unwrap();
    assert_eq!(md.len(), size);
    assert_eq!(md.mode() & 0o7777, 0o640);
    assert_eq!((md.mtime(), md.mtime_nsec()), (1_500_000_000, 123_456_789));
    assert!(md.is_file());
    assert_eq!(
        fs::read_link(mount.join("tree/a/link")).unwrap(),
        Path::new("../big")
    );
    assert!(fs::symlink_metadata(mount.join("tree/a/link"))
        .unwrap()
        .file_type()
        .is_symlink());
    assert_eq!(fs::metadata(mount.join("tree/a/b/empty")).unwrap().len(), 0);
    assert!(fs::read(mount.join("tree/a/b/empty")).unwrap().is_empty());
    assert_eq!(
        fs::read(mount.join("tree/a/link")).unwrap(),
        want,
        "through the link"
    );
    let mut names: Vec<String> = fs::read_dir(mount.join("tree/a"))
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    names.sort();
    assert_eq!(names, ["b", "link", "small"]);
    let missing = fs::metadata(mount.join("tree/nope")).unwrap_err();
    assert_eq!(missing.kind(), std::io::ErrorKind::NotFound);
    let damaged = mount.log_lines_with(&["stripe 1", "does not match"]);
    assert!(
        !damaged.is_empty(),
        "the damaged replica on n{bad_node} was not reported\n{}",
        mount.log()
    );

    // Reads at offsets that straddle stripe boundaries, and random ones.
    drop_caches();
    let file = File::open(mount.join("tree/big")).unwrap();
    let mut spots: Vec<(u64, usize)> = vec![
        (0, 4096),
        (MIB - 10, 20),
        (2 * MIB - 4095, 8192),
        (3 * MIB - 1, 1),
        (3 * MIB, 1),
        (4 * MIB - 100, 2 * MIB as usize + 200),
        (size - 123, 123),
        (size - 200, 200),
    ];
    let mut rng = rand::rngs::StdRng::seed_from_u64(7);
    for _ in 0..40 {
        let offset = rng.gen_range(0..size);
        let len = rng.gen_range(1..=(2 * MIB).min(size - offset)) as usize;
        spots.push((offset, len));
    }
    for (offset, len) in spots {
        let got = pread(&file, offset, len);
        let at = offset as usize;
        assert!(got == want[at..at + len], "{len} bytes at {offset} differ");
    }
    let mut past_end = [0u8; 16];
    assert_eq!(file.read_at(&mut past_end, size).unwrap(), 0);
    drop(file);

    // Every change is refused with EROFS.
    let erofs = nix::libc::EROFS;
    assert_eq!(errno_of(File::create(mount.join("tree/new"))), erofs);
    assert_eq!(
        errno_of(
            fs::OpenOptions::new()
                .write(true)
                .open(mount.join("tree/big"))
        ),
        erofs
    );
    assert_eq!(errno_of(fs::remove_file(mount.join("tree/a/small"))), erofs);
    assert_eq!(
        errno_of(fs::rename(mount.join("tree/big"), mount.join("tree/big2"))),
        erofs
    );
    assert_eq!(errno_of(fs::create_dir(mount.join("tree/d"))), erofs);
    assert_eq!(
        errno_of(fs::set_permissions(
            mount.join("tree/big"),
            fs::Permissions::from_mode(0o600)
        )),
        erofs
    );
    assert_eq!(fs::read(mount.join("tree/big")).unwrap(), want);

    // A node that is the first replica of the most stripes dies while a descriptor is
    // open on the file: the same descriptor, and a new open, read it whole.
    let mut first = [0usize; 4];
    for s in &layout.stripes {
        first[node_number(&s.replicas[0])] += 1;
    }
    // Not the only good replica of the damaged stripe 1: with it gone nothing could
    // serve that stripe.
    let good = node_number(&layout.stripes[1].replicas[1]);
    let victim = (1..=3)
        .filter(|&k| k != good)
        .max_by_key(|&k| first[k])
        .unwrap();
    let victim_id = cluster.node_id(victim);
    let mut open = File::open(mount.join("tree/big")).unwrap();
    let mut head = vec![0; MIB as usize];
    open.read_exact(&mut head).unwrap();
    assert!(head == want[..MIB as usize]);
    cluster.kill_node(victim);
    drop_caches();
    let started = Instant::now();
    assert!(
        pread(&open, 0, size as usize) == want,
        "the open descriptor"
    );
    drop(open);
    drop_caches();
    assert!(
        fs::read(mount.join("tree/big")).unwrap() == want,
        "a new open"
    );
    assert!(
        started.elapsed() < READ_LIMIT,
        "reads around a dead node took {:?}",
        started.elapsed()
    );
    let passed = mount.log_lines_with(&[&format!("node {victim_id}")]);
    assert!(
        !passed.is_empty(),
        "no replica on the dead node {victim_id} was passed over\n{}",
        mount.log()
    );
    // Metadata needs only etcd.
    assert_trees_equal(&tree, &mount.join("tree"));

    let stopped = mount.unmount();
    assert!(stopped.graceful, "{stopped:?}");
    assert_eq!(stopped.code, Some(0), "{stopped:?}");
}

#[test]
fn a_cluster_mount_of_a_directory_and_refusals() {
    let name = "a_cluster_mount_of_a_directory_and_refusals";
    if skip_without_cluster(name) || skip_without_fuse(name) {
        return;
    }
    let cluster = Cluster::start_with_share(2, "data", 1, 1);
    let tree = cluster.dir().join("local/t");
    fs::create_dir_all(tree.join("sub")).unwrap();
    write_random_file(&tree.join("sub/f"), 3 * MIB + 1, 5);
    rcp(rcp_args!["-r", &tree, cluster.url("data", "")]).assert_success();

    // A directory of the share as the root.
    let mount = Mount::builder(cluster.url("data", "t/sub"))
        .opt("ro")
        .start();
    assert_eq!(
        fs::read(mount.join("f")).unwrap(),
        fs::read(tree.join("sub/f")).unwrap()
    );
    assert!(fs::metadata(mount.path()).unwrap().is_dir());
    assert_eq!(errno_of(File::create(mount.join("g"))), nix::libc::EROFS);
    let stopped = mount.unmount();
    assert!(stopped.graceful, "{stopped:?}");

    let dir = tempfile::tempdir().unwrap();
    let mnt = dir.path().to_str().unwrap();
    // A missing share, a file as the root: cannot mount; a wrong secret:
    // authentication failed; no etcd: cannot connect.
    let noshare = ferry_mount(["-f", &cluster.url("nope", ""), mnt]);
    assert_eq!(noshare.code, Some(4), "{noshare}");
    assert!(
        noshare.stderr.contains("no cluster share 'nope'"),
        "{noshare}"
    );
    let file = ferry_mount(["-f", &cluster.url("data", "t/sub/f"), mnt]);
    assert_eq!(file.code, Some(4), "{file}");
    assert!(file.stderr.contains("not a directory"), "{file}");
    let secret = dir.path().join("wrong.secret");
    fs::write(&secret, "ferry-wrong-secret-0000000000\n").unwrap();
    fs::set_permissions(&secret, fs::Permissions::from_mode(0o600)).unwrap();
    let sub = tempfile::tempdir().unwrap();
    let wrong = ferry_mount([
        "-f",
        "--secret-file",
        secret.to_str().unwrap(),
        &cluster.url("data", ""),
        sub.path().to_str().unwrap(),
    ]);
    assert_eq!(wrong.code, Some(5), "{wrong}");
    let noetcd = ferry_mount(["-f", "-o", "timeout=3", "cluster://127.0.0.1:1/data", mnt]);
    assert_eq!(noetcd.code, Some(3), "{noetcd}");
}

/// The entry at `path` of share `data`, if any, from etcd.
fn entry_of(cluster: &Cluster, path: &str) -> Option<ferry_cluster::model::Entry> {
    let endpoint = cluster.etcd_endpoint();
    ferry_tests::runtime().block_on(async {
        let meta = ferry_cluster::Meta::connect(&ferry_cluster::EtcdConfig::plain(vec![endpoint]))
            .await
            .expect("etcd");
        meta.entry("data", path)
            .await
            .expect("etcd answers")
            .map(|v| v.entry)
    })
}

/// The stored objects of `layout` (share `data`) on every node that holds one.
fn objects_of(cluster: &Cluster, layout: &Layout) -> Vec<std::path::PathBuf> {
    let mut out = Vec::new();
    for (i, s) in layout.stripes.iter().enumerate() {
        for id in &s.replicas {
            let path = cluster
                .node_store(node_number(id))
                .join(layout.object_path("data", i));
            out.push(path);
        }
    }
    out
}

/// File `path` of share `data`, downloaded with `rcp` to `dest` (replaced).
fn fetch(cluster: &Cluster, path: &str, dest: &Path) {
    let _ = fs::remove_file(dest);
    rcp(rcp_args![cluster.url("data", path), dest]).assert_success();
}

#[test]
fn a_cluster_mount_writes_whole_files_at_close_and_changes_the_namespace() {
    let name = "a_cluster_mount_writes_whole_files_at_close_and_changes_the_namespace";
    if skip_without_cluster(name) || skip_without_fuse(name) {
        return;
    }
    let started = Instant::now();
    let mut cluster = Cluster::start_with_share(3, "data", 2, 1);
    let local = cluster.dir().join("local");
    let tree = local.join("src");
    fs::create_dir_all(tree.join("a/b")).unwrap();
    let big = 5 * MIB + 3;
    write_random_file(&tree.join("big"), big, 11);
    fs::set_permissions(tree.join("big"), fs::Permissions::from_mode(0o640)).unwrap();
    write_random_file(&tree.join("a/small"), 4000, 12);
    write_random_file(&tree.join("a/b/empty"), 0, 13);
    std::os::unix::fs::symlink("../big", tree.join("a/link")).unwrap();

    // Read-write by default.
    let mount = Mount::start(cluster.url("data", ""));
    let cp = std::process::Command::new("cp")
        .arg("-a")
        .arg(&tree)
        .arg(mount.join("w"))
        .output()
        .expect("cp");
    assert!(
        cp.status.success(),
        "cp -a: {}\n{}",
        String::from_utf8_lossy(&cp.stderr),
        mount.log()
    );
    let back = local.join("back");
    rcp(rcp_args!["-r", cluster.url("data", "w"), &back]).assert_success();
    assert_trees_equal(&tree, &back);
    let layout = layout_of(&cluster, "w/big");
    assert_eq!(layout.stripes.len(), 6, "5 MiB + 3 in 1 MiB stripes");
    assert_eq!(
        fs::read(mount.join("w/big")).unwrap(),
        fs::read(tree.join("big")).unwrap()
    );

    // A file being written is not visible before close; it is, whole, after.
    let mut pending = File::create(mount.join("w/pending")).unwrap();
    std::io::Write::write_all(&mut pending, &[7u8; 3000]).unwrap();
    pending.sync_data().ok();
    drop(pending);
    let mut later = File::create(mount.join("w/later")).unwrap();
    std::io::Write::write_all(&mut later, b"not yet").unwrap();
    assert!(
        entry_of(&cluster, "w/later").is_none(),
        "visible before close"
    );
    let missing = rcp(rcp_args![
        cluster.url("data", "w/later"),
        local.join("later")
    ]);
    assert_ne!(
        missing.code,
        Some(0),
        "{missing}\nentry now: {:?}\nlocal: {:?}",
        entry_of(&cluster, "w/later"),
        fs::read(local.join("later"))
    );
    assert_eq!(
        fs::metadata(mount.join("w/later")).unwrap().len(),
        7,
        "the writer sees its own file"
    );
    drop(later);
    fetch(&cluster, "w/later", &local.join("later"));
    assert_eq!(fs::read(local.join("later")).unwrap(), b"not yet");
    fetch(&cluster, "w/pending", &local.join("pending"));
    assert_eq!(fs::read(local.join("pending")).unwrap(), vec![7u8; 3000]);

    // Overwrite, then append: the new content, whole.
    let mut want: Vec<u8> = (0..3000u32).map(|i| (i * 7 % 251) as u8).collect();
    fs::write(mount.join("w/a/small"), &want).unwrap();
    fetch(&cluster, "w/a/small", &local.join("small"));
    assert_eq!(fs::read(local.join("small")).unwrap(), want);
    let mut f = fs::OpenOptions::new()
        .append(true)
        .open(mount.join("w/a/small"))
        .unwrap();
    std::io::Write::write_all(&mut f, b"-- appended").unwrap();
    drop(f);
    want.extend_from_slice(b"-- appended");
    fetch(&cluster, "w/a/small", &local.join("small"));
    assert_eq!(fs::read(local.join("small")).unwrap(), want);
    assert_eq!(fs::read(mount.join("w/a/small")).unwrap(), want);

    // Truncate on an open descriptor: published at close.
    let f = fs::OpenOptions::new()
        .write(true)
        .open(mount.join("w/a/small"))
        .unwrap();
    f.set_len(100).unwrap();
    drop(f);
    fetch(&cluster, "w/a/small", &local.join("small"));
    assert_eq!(fs::read(local.join("small")).unwrap(), want[..100]);

    // chmod and touch -m: the entry changes, seen by rcp.
    fs::set_permissions(mount.join("w/a/small"), fs::Permissions::from_mode(0o600)).unwrap();
    let touch = std::process::Command::new("touch")
        .args(["-m", "-d", "@1600000000"])
        .arg(mount.join("w/a/small"))
        .status()
        .expect("touch");
    assert!(touch.success());
    fetch(&cluster, "w/a/small", &local.join("small"));
    let md = fs::metadata(local.join("small")).unwrap();
    assert_eq!(md.mode() & 0o7777, 0o600);
    assert_eq!(md.mtime(), 1_600_000_000);
    assert_eq!(fs::read(local.join("small")).unwrap(), want[..100]);

    // truncate(2) of a name not open: fetched, truncated and published (to 0: an
    // empty file, nothing fetched).
    nix::unistd::truncate(&mount.join("w/a/small"), 40).expect("truncate to 40");
    fetch(&cluster, "w/a/small", &local.join("small"));
    assert_eq!(fs::read(local.join("small")).unwrap(), want[..40]);
    nix::unistd::truncate(&mount.join("w/pending"), 0).expect("truncate to 0");
    fetch(&cluster, "w/pending", &local.join("pending"));
    assert!(fs::read(local.join("pending")).unwrap().is_empty());

    // mkdir, rmdir: ENOTEMPTY while something is below.
    fs::create_dir(mount.join("w/d")).unwrap();
    fs::write(mount.join("w/d/f"), b"x").unwrap();
    assert!(
        entry_of(&cluster, "w/d").is_some_and(|e| e.kind == ferry_cluster::model::EntryKind::Dir)
    );
    let notempty = fs::remove_dir(mount.join("w/d")).unwrap_err();
    assert_eq!(notempty.raw_os_error(), Some(nix::libc::ENOTEMPTY));
    fs::remove_file(mount.join("w/d/f")).unwrap();
    fs::remove_dir(mount.join("w/d")).unwrap();
    assert!(entry_of(&cluster, "w/d").is_none());
    assert!(!mount.join("w/d").exists());

    // unlink: the entry and its objects go.
    let objects = objects_of(&cluster, &layout);
    assert!(objects.iter().all(|p| p.exists()), "{objects:?}");
    fs::remove_file(mount.join("w/big")).unwrap();
    assert!(entry_of(&cluster, "w/big").is_none());
    let left: Vec<_> = objects.iter().filter(|p| p.exists()).collect();
    assert!(left.is_empty(), "objects left after unlink: {left:?}");

    // rename over an existing file: one transaction; the replaced objects go.
    fs::write(mount.join("w/r1"), b"first").unwrap();
    fs::write(mount.join("w/r2"), b"second").unwrap();
    let replaced = objects_of(&cluster, &layout_of(&cluster, "w/r2"));
    fs::rename(mount.join("w/r1"), mount.join("w/r2")).unwrap();
    assert!(entry_of(&cluster, "w/r1").is_none());
    fetch(&cluster, "w/r2", &local.join("r2"));
    assert_eq!(fs::read(local.join("r2")).unwrap(), b"first");
    assert_eq!(fs::read(mount.join("w/r2")).unwrap(), b"first");
    assert!(!mount.join("w/r1").exists());
    let left: Vec<_> = replaced.iter().filter(|p| p.exists()).collect();
    assert!(left.is_empty(), "replaced objects left: {left:?}");

    // A directory renames with what is below it (tests/tests/cluster_rename.rs
    // covers the rest).
    fs::rename(mount.join("w/a"), mount.join("w/a2")).unwrap();
    assert!(mount.join("w/a2/b").is_dir());
    assert!(entry_of(&cluster, "w/a/b").is_none());

    // No node to store on: close gives EIO and nothing is published, neither a new
    // file nor a new version of an old one.
    let before = layout_of(&cluster, "w/r2");
    for k in 1..=3 {
        cluster.kill_node(k);
    }
    let mut new = File::create(mount.join("w/fails")).unwrap();
    std::io::Write::write_all(&mut new, b"never").unwrap();
    let closed = nix::unistd::close(std::os::fd::IntoRawFd::into_raw_fd(new));
    assert_eq!(closed, Err(nix::errno::Errno::EIO), "close");
    assert!(entry_of(&cluster, "w/fails").is_none());
    let mut over = File::create(mount.join("w/r2")).unwrap();
    std::io::Write::write_all(&mut over, b"never either").unwrap();
    let synced = over.sync_all().unwrap_err();
    assert_eq!(synced.raw_os_error(), Some(nix::libc::EIO), "fsync");
    let closed = nix::unistd::close(std::os::fd::IntoRawFd::into_raw_fd(over));
    assert_eq!(closed, Err(nix::errno::Errno::EIO), "close");
    assert_eq!(layout_of(&cluster, "w/r2").id, before.id);

    let stopped = mount.unmount();
    assert!(stopped.graceful, "{stopped:?}");
    assert_eq!(stopped.code, Some(0), "{stopped:?}");
    assert!(
        started.elapsed() < Duration::from_secs(120),
        "took {:?}",
        started.elapsed()
    );
}

#[test]
fn issue_41_a_mount_reads_around_a_hung_node() {
    let name = "issue_41_a_mount_reads_around_a_hung_node";
    if skip_without_cluster(name) || skip_without_fuse(name) {
        return;
    }
    // A stopped node stays registered for the whole test (its lease outlives it): the
    // mount's deadline, not etcd, must pass it over.
    let mut cluster = Cluster::start_with_share_ttl(3, "data", 2, 1, Duration::from_secs(60));
    let src = cluster.dir().join("f");
    write_random_file(&src, 8 * MIB, 41);
    rcp(rcp_args![&src, cluster.url("data", "f")]).assert_success();
    let want = fs::read(&src).unwrap();
    // Stripe 0's first replica: the node a read of the file tries first.
    let layout = layout_of(&cluster, "f");
    let hung = node_number(&layout.stripes[0].replicas[0]);
    let mount = Mount::builder(cluster.url("data", "")).opt("ro").start();
    let stopped = cluster.stop_node(hung);
    drop_caches();
    let started = Instant::now();
    let got = fs::read(mount.join("f")).unwrap();
    let took = started.elapsed();
    assert!(got == want, "the bytes read through the mount differ");
    assert!(
        cluster.node_stopped(hung),
        "node {hung} ran again during the read"
    );
    let named = mount.log_lines_with(&[&format!("storage node n{hung} is suspect")]);
    assert!(
        !named.is_empty(),
        "the mount did not pass node {hung} over\n{}",
        mount.log()
    );
    // Generous: the progress deadline is 2 s; a silent session used to cost 30.
    assert!(took < Duration::from_secs(20), "read took {took:?}");
    stopped.cont();
}

/// Copy-on-write per stripe through the mount: a one-byte change to a file of seven
/// stripes publishes one new stripe (exactly `replicas` new objects, all of it); the
/// other stripes name the first version's objects; the file reads back byte for byte
/// with `rcp` and through a second mount.
#[test]
fn a_one_byte_write_through_the_mount_sends_one_stripe() {
    let name = "a_one_byte_write_through_the_mount_sends_one_stripe";
    if skip_without_cluster(name) || skip_without_fuse(name) {
        return;
    }
    let cluster = Cluster::start_with_share(3, "data", 2, 1);
    let local = cluster.dir().join("f");
    write_random_file(&local, 6 * MIB + 11, 7);
    rcp(rcp_args![&local, cluster.url("data", "f")]).assert_success();
    let a = layout_of(&cluster, "f");
    let before = cluster.objects();

    let mount = Mount::start(cluster.url("data", ""));
    let at = 3 * MIB + 5;
    let f = fs::OpenOptions::new()
        .write(true)
        .open(mount.join("f"))
        .unwrap();
    f.write_all_at(b"!", at).unwrap();
    drop(f);
    let local_f = fs::OpenOptions::new().write(true).open(&local).unwrap();
    local_f.write_all_at(b"!", at).unwrap();

    let b = layout_of(&cluster, "f");
    assert_ne!(a.id, b.id, "a new version");
    let after = cluster.objects();
    let new: Vec<_> = after.keys().filter(|k| !before.contains_key(*k)).collect();
    assert_eq!(new.len(), 2, "one stripe, to its 2 replicas: {new:?}");
    assert!(new.iter().all(|(_, o)| *o == b.object_path("data", 3)));
    assert!(new.iter().all(|k| after[*k] == MIB));
    for i in (0..7).filter(|i| *i != 3) {
        assert_eq!(
            b.object_path("data", i),
            a.object_path("data", i),
            "stripe {i}"
        );
    }
    let back = cluster.dir().join("back");
    rcp(rcp_args![cluster.url("data", "f"), &back]).assert_success();
    assert_eq!(fs::read(&back).unwrap(), fs::read(&local).unwrap());
    let other = Mount::builder(cluster.url("data", "")).opt("ro").start();
    assert_eq!(
        fs::read(other.join("f")).unwrap(),
        fs::read(&local).unwrap()
    );
}
