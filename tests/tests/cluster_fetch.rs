//! Writes through a cluster mount fetch only the stripes they touch (issue 43, point
//! 2): a descriptor opened for writing stages nothing at open; a write fetches the
//! stripes it does not cover whole, a truncate the stripe it cuts; reads of the others
//! come from the version opened; the close sends only the changed stripes.
//!
//! The measure is the nodes' own: every node counts the bytes it pushed into clients'
//! memory (`write_bytes`: a fetch is a download the node pushes) and pulled from it
//! (`read_bytes`: an upload), summed over the nodes by [`Cluster::traffic`]. A mount's
//! reads are its one-sided READs and count in neither, so `write_bytes` moves only by
//! what the mount fetched for writing.
//!
//! Two mounts writing one file at once: the file is one writer's version, whole; no
//! layout names a missing object; `ferry cluster gc` leaves it whole.
//!
//! Needs root, etcd and FUSE (skipped otherwise, with the reason).

use std::fs::{self, File, OpenOptions};
use std::os::unix::fs::FileExt;
use std::path::Path;

use ferry_cluster::model::Layout;
use ferry_tests::{
    rcp, rcp_args, skip_without_cluster, skip_without_fuse, write_random_file, Cluster, Mount, MIB,
};

/// The share's stripes: 1 MiB, so a file of a few MiB has several.
const STRIPE: u64 = MIB;

/// Bytes the nodes pushed (fetched by clients) and pulled (sent by clients) since
/// `before`.
fn moved(cluster: &Cluster, before: ferry_common::msg::Counters) -> (u64, u64) {
    let now = cluster.traffic();
    (
        now.write_bytes - before.write_bytes,
        now.read_bytes - before.read_bytes,
    )
}

/// Unless test `name` is skipped (no root, etcd or FUSE: `None`), a cluster of 3
/// nodes, share `data` (2 replicas, 1 MiB stripes), holding `f`: 6 MiB and 11 random
/// bytes (7 stripes). Returns the cluster and the file's bytes.
fn cluster_with_file(name: &str, seed: u64) -> Option<(Cluster, Vec<u8>)> {
    if skip_without_cluster(name) || skip_without_fuse(name) {
        return None;
    }
    let cluster = Cluster::start_with_share(3, "data", 2, 1);
    let local = cluster.dir().join("f");
    write_random_file(&local, 6 * MIB + 11, seed);
    rcp(rcp_args![&local, cluster.url("data", "f")]).assert_success();
    let bytes = fs::read(&local).unwrap();
    Some((cluster, bytes))
}

/// `data/f` read back whole through `rcp` and through a fresh read-only mount, each
/// compared byte for byte with `want`.
fn assert_reads_back(cluster: &Cluster, want: &[u8]) {
    let back = cluster.dir().join("back");
    let _ = fs::remove_file(&back);
    rcp(rcp_args![cluster.url("data", "f"), &back]).assert_success();
    assert!(fs::read(&back).unwrap() == want, "rcp reads other bytes");
    let other = Mount::builder(cluster.url("data", "")).opt("ro").start();
    assert!(
        fs::read(other.join("f")).unwrap() == want,
        "a second mount reads other bytes"
    );
}

/// Every object `layout` (of a file of `size` bytes) names is on every node its stripe
/// lists, with the stripe's length.
fn assert_objects_there(cluster: &Cluster, layout: &Layout, size: u64) {
    for (i, s) in layout.stripes.iter().enumerate() {
        for node in &s.replicas {
            let k: usize = node.trim_start_matches('n').parse().expect("node nK");
            let path = cluster.node_store(k).join(layout.object_path("data", i));
            let md = fs::metadata(&path)
                .unwrap_or_else(|e| panic!("stripe {i} on {node}: {}: {e}", path.display()));
            let r = layout.stripe_range(size, i);
            assert_eq!(md.len(), r.end - r.start, "stripe {i} on {node}");
        }
    }
}

fn open_rw(path: &Path) -> File {
    OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)
        .unwrap_or_else(|e| panic!("open {}: {e}", path.display()))
}

/// Every byte of `f` from offset 0 to its end, read through the descriptor with pread.
fn read_to_end(f: &File) -> Vec<u8> {
    let mut out = Vec::new();
    let mut buf = vec![0; 256 << 10];
    loop {
        match f.read_at(&mut buf, out.len() as u64) {
            Ok(0) => return out,
            Ok(n) => out.extend_from_slice(&buf[..n]),
            Err(e) => panic!("pread at {}: {e}", out.len()),
        }
    }
}

/// A one-byte write in the middle of a file of 7 stripes fetches exactly one stripe
/// and sends exactly one (to its 2 replicas); reads of the other stripes through the
/// same descriptor fetch nothing and return the file's bytes; a write across a stripe
/// boundary fetches the two stripes it touches.
#[test]
fn a_one_byte_write_fetches_one_stripe_and_sends_one() {
    let Some((cluster, mut want)) =
        cluster_with_file("a_one_byte_write_fetches_one_stripe_and_sends_one", 31)
    else {
        return;
    };
    let mount = Mount::start(cluster.url("data", ""));

    let before = cluster.traffic();
    let f = open_rw(&mount.join("f"));
    assert_eq!(
        moved(&cluster, before),
        (0, 0),
        "the open fetched something"
    );
    let at = 3 * STRIPE + 5;
    f.write_all_at(b"!", at).unwrap();
    want[at as usize] = b'!';
    assert_eq!(
        moved(&cluster, before).0,
        STRIPE,
        "the write fetched other than one stripe"
    );
    // Every byte through the descriptor: the untouched stripes come from the version
    // opened (fetching nothing), the written one from the staging file.
    assert!(read_to_end(&f) == want, "read through the write descriptor");
    assert_eq!(moved(&cluster, before).0, STRIPE, "a read fetched a stripe");
    drop(f);
    assert_eq!(
        moved(&cluster, before),
        (STRIPE, 2 * STRIPE),
        "(fetched, sent): one stripe fetched, one stripe sent to its 2 replicas"
    );
    assert_reads_back(&cluster, &want);

    // Across the boundary of stripes 1 and 2: both fetched, both sent.
    let before = cluster.traffic();
    let f = open_rw(&mount.join("f"));
    let at = 2 * STRIPE - 3;
    f.write_all_at(b"across", at).unwrap();
    want[at as usize..at as usize + 6].copy_from_slice(b"across");
    drop(f);
    assert_eq!(moved(&cluster, before), (2 * STRIPE, 4 * STRIPE));
    assert_reads_back(&cluster, &want);
    let layout = cluster.layout_of("data", "f");
    assert_objects_there(&cluster, &layout, want.len() as u64);
}

/// ftruncate to the middle of a stripe fetches that stripe only (the ones past it are
/// dropped unread), an append after it fetches nothing more; a truncate to a stripe
/// boundary and a growth fetch nothing; every version reads back byte for byte.
#[test]
fn a_truncate_fetches_only_the_stripe_it_cuts() {
    let Some((cluster, mut want)) =
        cluster_with_file("a_truncate_fetches_only_the_stripe_it_cuts", 32)
    else {
        return;
    };
    let mount = Mount::start(cluster.url("data", ""));

    let before = cluster.traffic();
    let f = open_rw(&mount.join("f"));
    let cut = 3 * STRIPE + 100;
    f.set_len(cut).unwrap();
    assert_eq!(moved(&cluster, before).0, STRIPE, "the cut stripe only");
    f.write_all_at(b"appended after the cut", cut).unwrap();
    want.truncate(cut as usize);
    want.extend_from_slice(b"appended after the cut");
    assert!(read_to_end(&f) == want, "read through the descriptor");
    drop(f);
    // Stripes 0..3 kept; stripe 3 (cut, appended to: 122 bytes) sent to its 2
    // replicas.
    let stripe_3 = want.len() as u64 - 3 * STRIPE;
    assert_eq!(moved(&cluster, before), (STRIPE, 2 * stripe_3));
    assert_reads_back(&cluster, &want);

    // To a stripe boundary, then grown: nothing to fetch; the growth is zeros.
    let before = cluster.traffic();
    let f = open_rw(&mount.join("f"));
    f.set_len(2 * STRIPE).unwrap();
    f.set_len(3 * STRIPE + 7).unwrap();
    drop(f);
    want.truncate(2 * STRIPE as usize);
    want.resize(3 * STRIPE as usize + 7, 0);
    assert_eq!(moved(&cluster, before).0, 0, "nothing fetched");
    assert_reads_back(&cluster, &want);

    // A path truncate (truncate(2), no descriptor): the cut stripe only.
    let before = cluster.traffic();
    let cut = STRIPE + 10;
    nix::unistd::truncate(&mount.join("f"), cut as i64).unwrap();
    want.truncate(cut as usize);
    assert_eq!(
        moved(&cluster, before).0,
        STRIPE,
        "truncate(2): the cut stripe"
    );
    assert_reads_back(&cluster, &want);
    // truncate(1): an open for writing and an ftruncate.
    let before = cluster.traffic();
    let status = std::process::Command::new("truncate")
        .args(["-s", "100"])
        .arg(mount.join("f"))
        .status()
        .expect("truncate");
    assert!(status.success());
    want.truncate(100);
    assert_eq!(
        moved(&cluster, before).0,
        STRIPE,
        "truncate(1): the cut stripe"
    );
    assert_reads_back(&cluster, &want);

    // truncate(2) while a descriptor holds the file open for writing, unchanged: the
    // descriptor is kept in step (its cut stripe fetched before the publication
    // removed the old object) and reads the truncated file.
    let f = open_rw(&mount.join("f"));
    nix::unistd::truncate(&mount.join("f"), 50).unwrap();
    want.truncate(50);
    assert!(
        read_to_end(&f) == want,
        "the open descriptor reads other bytes"
    );
    drop(f);
    assert_reads_back(&cluster, &want);
    let layout = cluster.layout_of("data", "f");
    assert_objects_there(&cluster, &layout, want.len() as u64);
}

/// One round of two mounts writing `f` at once: mount 1 opens it for writing and
/// writes `mine` at `my_at`, mount 2 then writes `theirs` at `their_at` and closes,
/// then mount 1 closes. Returns mount 1's close (its `fsync`, which publishes), the
/// bytes the nodes pushed during it, and what mount 1 and mount 2 meant the file to be.
fn race(
    cluster: &Cluster,
    (m1, m2): (&Mount, &Mount),
    (my_at, mine): (u64, &[u8]),
    (their_at, theirs): (u64, &[u8]),
) -> (std::io::Result<()>, u64, Vec<u8>, Vec<u8>) {
    let start = cluster.dir().join("start");
    let _ = fs::remove_file(&start);
    rcp(rcp_args![cluster.url("data", "f"), &start]).assert_success();
    let base = fs::read(&start).unwrap();
    let f1 = open_rw(&m1.join("f"));
    f1.write_all_at(mine, my_at).unwrap();
    let f2 = open_rw(&m2.join("f"));
    f2.write_all_at(theirs, their_at).unwrap();
    drop(f2);
    let before = cluster.traffic();
    let closed = f1.sync_all();
    let fetched = moved(cluster, before).0;
    drop(f1);
    let mut v1 = base.clone();
    v1[my_at as usize..my_at as usize + mine.len()].copy_from_slice(mine);
    let mut v2 = base;
    v2[their_at as usize..their_at as usize + theirs.len()].copy_from_slice(theirs);
    (closed, fetched, v1, v2)
}

/// Two mounts write one file at once, three rounds. The later close publishes its
/// version only with what the version there now names or what it can still fetch from
/// the version it opened: (1) both changed the same stripe: its other stripes are the
/// ones the other version names, it wins, nothing fetched; (2) the other changed a
/// stripe this one never fetched, whose object survived (it was borrowed from an older
/// version): fetched at the close and sent, it wins; (3) the other changed a stripe
/// this one never fetched and its object is gone: the close fails with EIO and says
/// why, the other version stays. Every time the file is one writer's version, whole,
/// and every object its layout names is there; `ferry cluster gc --grace 0` after
/// leaves it whole.
#[test]
fn two_mounts_writing_one_file_leave_one_whole_version() {
    let name = "two_mounts_writing_one_file_leave_one_whole_version";
    let Some((cluster, _)) = cluster_with_file(name, 33) else {
        return;
    };
    let m1 = Mount::builder(cluster.url("data", ""))
        .opt("attr_timeout=0")
        .start();
    let m2 = Mount::builder(cluster.url("data", ""))
        .opt("attr_timeout=0")
        .start();
    let size = 6 * MIB + 11;
    let check = |want: &[u8]| {
        assert_reads_back(&cluster, want);
        assert_objects_there(&cluster, &cluster.layout_of("data", "f"), size);
    };

    // (1) The same stripe: mount 1's version, all but stripe 3 the first version's.
    let (closed, fetched, v1, _) = race(
        &cluster,
        (&m1, &m2),
        (3 * STRIPE + 1, b"one"),
        (3 * STRIPE + 9, b"two"),
    );
    closed.unwrap_or_else(|e| panic!("round 1: mount 1's close: {e}\n{}", m1.log()));
    assert_eq!(fetched, 0, "round 1: nothing to fetch at the close");
    check(&v1);

    // (2) Mount 2 changes stripe 5, which mount 1 never fetched; the version mount 1
    // opened borrowed it from the first version, so it is still there: fetched, sent.
    let (closed, fetched, v1, _) = race(
        &cluster,
        (&m1, &m2),
        (STRIPE + 2, b"three"),
        (5 * STRIPE + 4, b"four"),
    );
    closed.unwrap_or_else(|e| panic!("round 2: mount 1's close: {e}\n{}", m1.log()));
    assert_eq!(fetched, STRIPE, "round 2: stripe 5 fetched at the close");
    check(&v1);

    // (3) Mount 2 changes stripe 1, mount 1's own object of round 2, which mount 1
    // (now writing stripe 3) never fetched: removed with the version it replaced.
    let (closed, _, _, v2) = race(
        &cluster,
        (&m1, &m2),
        (3 * STRIPE + 7, b"five"),
        (STRIPE + 8, b"six"),
    );
    let e = closed.expect_err("round 3: mount 1's close must fail: its data is gone");
    assert_eq!(e.raw_os_error(), Some(nix::libc::EIO), "{e}");
    let said = m1.log_lines_with(&["stripe 1 of the version this file was opened at"]);
    assert!(
        !said.is_empty(),
        "the mount's log does not say why\n{}",
        m1.log()
    );
    check(&v2);

    let etcd = cluster.etcd_endpoint();
    let gc = cluster.ferry(["cluster", "gc", "--grace", "0", "--etcd", &etcd]);
    gc.assert_success();
    check(&v2);
}
