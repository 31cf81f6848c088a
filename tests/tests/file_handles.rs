//! The requests of a writable mount (the `write` capability) against a real ferryd:
//! a staged file written through a handle takes its name only at close, with exactly
//! the bytes written; a file written in place, read back with hashes, truncated; a
//! write whose hash is wrong changes nothing; `Move` with and without `no_replace`;
//! `SetAttrs` on a path; a read-only share refuses; a connection dropped with a staged
//! file open leaves nothing behind; the traffic counters count what moved.

use std::fs;
use std::os::unix::fs::MetadataExt;
use std::sync::Arc;
use std::time::{Duration, Instant};

use ferry_client::{Client, ClientError};
use ferry_common::chunk::{hash_chunk, hash_chunks};
use ferry_common::msg::{ErrorKind, Extent, HashAlgorithm, SetAttrs, Timestamp};
use ferry_common::transport::{Access, Buffer, Memory, Registration};
use ferry_tests::{rcp_args, runtime, temp_files, test_choice, Env, DEFAULT_SHARE};

const S: &str = DEFAULT_SHARE;

async fn connect(env: &Env) -> Client {
    let c = ferry_tests::connect(env.server(), test_choice())
        .await
        .expect("a session");
    assert!(c.can_write(), "ferryd offers the write capability");
    c
}

fn algorithm(c: &Client) -> HashAlgorithm {
    c.negotiated().expect("negotiated").hash
}

/// Registers a buffer holding `bytes` (readable by the server).
async fn source(c: &Client, bytes: &[u8]) -> Registration {
    let buf = Buffer::new(bytes.len()).unwrap();
    buf.write().await.copy_from_slice(bytes);
    c.transport()
        .register(Memory::Buffer(buf), Access::RemoteRead)
        .unwrap()
}

/// Registers an empty buffer of `len` bytes the server may write.
fn sink(c: &Client, len: usize) -> (Arc<Buffer>, Registration) {
    let buf = Buffer::new(len).unwrap();
    let reg = c
        .transport()
        .register(Memory::Buffer(buf.clone()), Access::RemoteWrite)
        .unwrap();
    (buf, reg)
}

/// Writes `bytes` at file offset `at` through `handle`, as extents of `lens` (which add
/// up to `bytes.len()`), each with its hash; returns the size the server reports.
async fn write(
    c: &Client,
    handle: u64,
    at: u64,
    bytes: &[u8],
    lens: &[u32],
) -> Result<u64, ClientError> {
    let reg = source(c, bytes).await;
    let a = algorithm(c);
    let (extents, hashes) = extents_of(a, at, bytes, lens);
    c.file_write(handle, reg.desc(), a, extents, hashes).await
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed) ^ (i >> 11) as u8)
        .collect()
}

fn kind<T: std::fmt::Debug>(r: Result<T, ClientError>) -> ErrorKind {
    r.expect_err("refused")
        .remote_kind()
        .expect("a remote error")
}

#[test]
fn a_staged_file_takes_its_name_at_close_with_exactly_its_bytes() {
    let env = Env::new();
    runtime().block_on(async {
        let c = connect(&env).await;
        let before = c.counters().await.unwrap();
        let data = pattern(2_500_000, 1);
        // Extents of every size up to a chunk: several go in one READ, one fills one.
        let lens = [100_000, 300_000, 1 << 20, 51_424, 1_000_000];
        let f = c
            .file_open(S, "new.bin", Some(0o640), true, false)
            .await
            .unwrap();
        assert!(f.staged);
        let size = write(&c, f.handle, 0, &data, &lens).await.unwrap();
        assert_eq!(size, data.len() as u64);
        assert!(!env.share("new.bin").exists(), "visible before close");
        assert_eq!(temp_files(&env.share("")).len(), 1);
        let attr = c.file_close(f.handle).await.unwrap();
        assert_eq!(attr.size, data.len() as u64);
        assert_eq!(fs::read(env.share("new.bin")).unwrap(), data);
        let meta = fs::metadata(env.share("new.bin")).unwrap();
        assert_eq!(meta.mode() & 0o7777, 0o640);
        assert_eq!(meta.ino(), f.attr.ino, "the hidden file took the name");
        assert!(temp_files(&env.share("")).is_empty());
        // A closed handle is gone.
        assert_eq!(
            kind(c.file_sync(f.handle, false).await),
            ErrorKind::Protocol
        );

        let after = c.counters().await.unwrap();
        let n = data.len() as u64;
        assert!(after.file_written_bytes >= before.file_written_bytes + n);
        assert!(after.read_bytes >= before.read_bytes + n);
        assert!(after.ctrl_received_bytes > before.ctrl_received_bytes);
        assert!(after.ctrl_sent_bytes > before.ctrl_sent_bytes);

        // Read back in place, with hashes of the server's chunk size.
        let f = c.file_open(S, "new.bin", None, false, false).await.unwrap();
        assert!(!f.staged);
        let (buf, reg) = sink(&c, data.len() + 10);
        let got = c.file_read(f.handle, 0, reg.desc()).await.unwrap();
        assert_eq!(got.len, data.len() as u64);
        assert_eq!(got.hashes, hash_chunks(got.algorithm, &data, 1 << 20));
        assert_eq!(&buf.read().await[..data.len()], &data[..]);
        // Short at the end, nothing past it.
        let got = c.file_read(f.handle, n - 5, reg.desc()).await.unwrap();
        assert_eq!(got.len, 5);
        assert_eq!(&buf.read().await[..5], &data[data.len() - 5..]);
        let got = c.file_read(f.handle, n + 1, reg.desc()).await.unwrap();
        assert_eq!((got.len, got.hashes.len()), (0, 0));
        assert!(c.counters().await.unwrap().write_bytes >= after.write_bytes + n);
        c.file_close(f.handle).await.unwrap();

        // A symlink is never followed.
        std::os::unix::fs::symlink("new.bin", env.share("link")).unwrap();
        let e = c.file_open(S, "link", None, false, false).await;
        assert_eq!(kind(e), ErrorKind::InvalidPath);
        // Exclusive of a name that exists.
        let e = c.file_open(S, "new.bin", Some(0o600), true, false).await;
        assert_eq!(kind(e), ErrorKind::Exists);
        // Missing without create.
        let e = c.file_open(S, "missing", None, false, false).await;
        assert_eq!(kind(e), ErrorKind::NotFound);
    });
}

#[test]
fn a_file_written_in_place_and_a_wrong_hash_that_changes_nothing() {
    let env = Env::new();
    let old = pattern(10_000, 2);
    fs::write(env.share("f"), &old).unwrap();
    runtime().block_on(async {
        let c = connect(&env).await;
        let f = c.file_open(S, "f", None, false, false).await.unwrap();
        assert!(!f.staged);
        let patch = pattern(100, 9);
        write(&c, f.handle, 1000, &patch, &[40, 60]).await.unwrap();
        c.file_sync(f.handle, true).await.unwrap();
        let mut want = old.clone();
        want[1000..1100].copy_from_slice(&patch);
        assert_eq!(fs::read(env.share("f")).unwrap(), want);

        // A hash that does not match: refused, nothing of it written.
        let reg = source(&c, &[0xAA; 64]).await;
        let a = algorithm(&c);
        let e = c
            .file_write(
                f.handle,
                reg.desc(),
                a,
                vec![Extent {
                    offset: 4096,
                    len: 64,
                }],
                vec![hash_chunk(a, &[0xAB; 64])],
            )
            .await
            .unwrap_err();
        assert_eq!(e.remote_kind(), Some(ErrorKind::Integrity));
        assert!(e.to_string().contains("offset 4096"), "{e}");
        assert_eq!(fs::read(env.share("f")).unwrap(), want);

        // Truncation through the handle.
        let attr = c
            .file_set_attr(
                f.handle,
                SetAttrs {
                    size: Some(500),
                    ..SetAttrs::default()
                },
            )
            .await
            .unwrap();
        assert_eq!(attr.size, 500);
        // Space allocated past the end: kept size, or grown.
        let attr = c.file_allocate(f.handle, 0, 8192, true).await.unwrap();
        assert_eq!(attr.size, 500);
        let attr = c.file_allocate(f.handle, 500, 100, false).await.unwrap();
        assert_eq!(attr.size, 600);
        let attr = c
            .file_set_attr(
                f.handle,
                SetAttrs {
                    size: Some(500),
                    ..SetAttrs::default()
                },
            )
            .await
            .unwrap();
        assert_eq!(attr.size, 500);
        c.file_close(f.handle).await.unwrap();
        assert_eq!(fs::read(env.share("f")).unwrap(), &want[..500]);

        // Truncating open: staged, the old content readable until the close.
        let f = c.file_open(S, "f", None, false, true).await.unwrap();
        assert!(f.staged);
        write(&c, f.handle, 0, b"new", &[3]).await.unwrap();
        assert_eq!(fs::read(env.share("f")).unwrap(), &want[..500]);
        c.file_close(f.handle).await.unwrap();
        assert_eq!(fs::read(env.share("f")).unwrap(), b"new");
    });
}

#[test]
fn move_and_set_attrs_act_on_paths_in_the_share() {
    let env = Env::new();
    fs::write(env.share("a"), b"a").unwrap();
    fs::write(env.share("b"), b"b").unwrap();
    fs::create_dir_all(env.share("full/x")).unwrap();
    fs::create_dir(env.share("empty")).unwrap();
    runtime().block_on(async {
        let c = connect(&env).await;
        assert_eq!(
            kind(c.move_entry(S, "a", "b", true).await),
            ErrorKind::Exists
        );
        assert_eq!(fs::read(env.share("b")).unwrap(), b"b");
        c.move_entry(S, "a", "b", false).await.unwrap();
        assert!(!env.share("a").exists());
        assert_eq!(fs::read(env.share("b")).unwrap(), b"a");
        c.move_entry(S, "b", "full/c", true).await.unwrap();
        assert_eq!(fs::read(env.share("full/c")).unwrap(), b"a");
        assert_eq!(
            kind(c.move_entry(S, "empty", "full", false).await),
            ErrorKind::NotEmpty
        );
        assert_eq!(
            kind(c.move_entry(S, "full/c", "../out", false).await),
            ErrorKind::OutsideShare
        );
        assert_eq!(
            kind(c.move_entry(S, "full/c", ".ferry-tmp.x", false).await),
            ErrorKind::InvalidPath
        );

        let t = Timestamp {
            secs: 1_234_567_890,
            nanos: 42,
        };
        let attr = c
            .set_attrs(
                S,
                "full/c",
                SetAttrs {
                    mode: Some(0o604),
                    mtime: Some(t),
                    ..SetAttrs::default()
                },
            )
            .await
            .unwrap();
        assert_eq!((attr.mode & 0o7777, attr.mtime), (0o604, t));
        let meta = fs::metadata(env.share("full/c")).unwrap();
        assert_eq!(meta.mode() & 0o7777, 0o604);
        assert_eq!((meta.mtime(), meta.mtime_nsec()), (1_234_567_890, 42));
    });
}

#[test]
fn a_read_only_share_refuses_writes_and_says_so() {
    let env = Env::with_shares(&[(S, false), ("ro", true)]);
    fs::write(env.share_dir("ro").join("f"), b"x").unwrap();
    runtime().block_on(async {
        let c = connect(&env).await;
        assert!(c.share_access(S).await.unwrap());
        assert!(!c.share_access("ro").await.unwrap());
        let e = c.file_open("ro", "f", None, false, false).await;
        assert_eq!(kind(e), ErrorKind::ReadOnly);
        let e = c.file_open("ro", "g", Some(0o644), false, false).await;
        assert_eq!(kind(e), ErrorKind::ReadOnly);
        assert_eq!(
            kind(c.move_entry("ro", "f", "g", false).await),
            ErrorKind::ReadOnly
        );
        let e = c.set_attrs("ro", "f", SetAttrs::default()).await;
        assert_eq!(kind(e), ErrorKind::ReadOnly);
    });
    assert_eq!(fs::read(env.share_dir("ro").join("f")).unwrap(), b"x");
}

#[test]
fn a_connection_dropped_with_a_staged_file_open_leaves_nothing() {
    let env = Env::new();
    let rt = runtime();
    rt.block_on(async {
        let c = connect(&env).await;
        let f = c
            .file_open(S, "never", Some(0o644), false, false)
            .await
            .unwrap();
        write(&c, f.handle, 0, &pattern(5000, 3), &[5000])
            .await
            .unwrap();
        assert_eq!(temp_files(&env.share("")).len(), 1);
        c.close();
    });
    let deadline = Instant::now() + Duration::from_secs(5);
    while !temp_files(&env.share("")).is_empty() {
        assert!(
            Instant::now() < deadline,
            "hidden file left: {:?}",
            temp_files(&env.share(""))
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(!env.share("never").exists());
}

#[test]
fn a_file_rewritten_in_place_is_never_served_with_its_old_manifest() {
    let env = Env::new();
    let len = 3 << 20;
    let old = pattern(len, 4);
    fs::create_dir_all(env.local("")).unwrap();
    fs::write(env.local("m.bin"), &old).unwrap();
    // The upload records the file's manifest in the share's store.
    env.rcp(rcp_args![env.local("m.bin"), env.remote("m.bin")])
        .assert_success();
    let mut new = old.clone();
    let patch = pattern(4096, 5);
    new[(1 << 20) + 10..(1 << 20) + 10 + 4096].copy_from_slice(&patch);
    runtime().block_on(async {
        let c = connect(&env).await;
        let f = c.file_open(S, "m.bin", None, false, false).await.unwrap();
        // Same size, at once: on a filesystem with coarse timestamps (ext4) the file's
        // key may not move within the tick, and only the server forgetting the record
        // keeps the download right (where timestamps are fine, the key moves anyway;
        // the forgetting itself is unit-tested in server/src/files.rs).
        write(&c, f.handle, (1 << 20) + 10, &patch, &[4096])
            .await
            .unwrap();
        c.file_close(f.handle).await.unwrap();
    });
    assert_eq!(fs::read(env.share("m.bin")).unwrap(), new);
    env.rcp(rcp_args![env.remote("m.bin"), env.local("back.bin")])
        .assert_success();
    assert_eq!(fs::read(env.local("back.bin")).unwrap(), new);
}

/// Extents of `bytes` at file offset `at`, one per `lens`, with their hashes.
fn extents_of(
    a: HashAlgorithm,
    at: u64,
    bytes: &[u8],
    lens: &[u32],
) -> (Vec<Extent>, Vec<[u8; 32]>) {
    let (mut extents, mut hashes, mut pos) = (Vec::new(), Vec::new(), 0usize);
    for &len in lens {
        extents.push(Extent {
            offset: at + pos as u64,
            len,
        });
        hashes.push(hash_chunk(a, &bytes[pos..pos + len as usize]));
        pos += len as usize;
    }
    assert_eq!(pos, bytes.len());
    (extents, hashes)
}

#[test]
fn a_finish_writes_sets_attributes_and_names_in_one_request() {
    let env = Env::new();
    runtime().block_on(async {
        let c = connect(&env).await;
        assert!(c.has_finish(), "ferryd offers the finish capability");
        let a = algorithm(&c);
        let mtime = Timestamp {
            secs: 1_000_000_000,
            nanos: 5,
        };
        let attrs = SetAttrs {
            mode: Some(0o604),
            mtime: Some(mtime),
            ..SetAttrs::default()
        };

        // Data, attributes and the name, in that order: the mtime is the one set.
        let data = pattern(1_500_000, 7);
        let f = c
            .file_open(S, "fin.bin", Some(0o600), true, false)
            .await
            .unwrap();
        assert!(f.staged);
        let reg = source(&c, &data).await;
        let (extents, hashes) = extents_of(a, 0, &data, &[1 << 20, 451_424]);
        let attr = c
            .file_finish(
                f.handle,
                Some((reg.desc(), extents, hashes)),
                a,
                attrs,
                true,
            )
            .await
            .unwrap();
        assert_eq!(attr.size, data.len() as u64);
        assert_eq!(fs::read(env.share("fin.bin")).unwrap(), data);
        let meta = fs::metadata(env.share("fin.bin")).unwrap();
        assert_eq!(meta.mode() & 0o7777, 0o604);
        assert_eq!((meta.mtime(), meta.mtime_nsec()), (1_000_000_000, 5));
        assert_eq!(meta.ino(), f.attr.ino, "the hidden file took the name");
        assert!(temp_files(&env.share("")).is_empty());
        c.file_close(f.handle).await.unwrap();

        // Nothing to write: attributes only, on a file in place, no commit.
        let f = c.file_open(S, "fin.bin", None, false, false).await.unwrap();
        let none = SetAttrs {
            mode: Some(0o640),
            ..SetAttrs::default()
        };
        let attr = c.file_finish(f.handle, None, a, none, false).await.unwrap();
        assert_eq!(attr.mode & 0o7777, 0o640);
        assert_eq!(fs::read(env.share("fin.bin")).unwrap(), data);
        // No extents but a region or hashes: refused by shape.
        let bad = Some((reg.desc(), vec![], vec![]));
        let e = c
            .file_finish(f.handle, bad, a, SetAttrs::default(), false)
            .await;
        assert_eq!(kind(e), ErrorKind::Protocol);
        c.file_close(f.handle).await.unwrap();

        // A wrong hash: nothing is written, no attribute set, no name taken, and the
        // staged file goes with its handle.
        let f = c
            .file_open(S, "bad.bin", Some(0o600), true, false)
            .await
            .unwrap();
        let (extents, mut hashes) = extents_of(a, 0, &data[..4096], &[4096]);
        hashes[0][0] ^= 1;
        let reg = source(&c, &data[..4096]).await;
        let e = c
            .file_finish(
                f.handle,
                Some((reg.desc(), extents, hashes)),
                a,
                attrs,
                true,
            )
            .await;
        assert_eq!(kind(e), ErrorKind::Integrity);
        assert!(!env.share("bad.bin").exists(), "named after a failed write");
        c.file_discard(f.handle).await.unwrap();
        assert!(temp_files(&env.share("")).is_empty());
    });
}

#[test]
fn a_put_makes_writes_and_names_a_whole_file_or_nothing() {
    let env = Env::new();
    runtime().block_on(async {
        let c = connect(&env).await;
        let a = algorithm(&c);
        let mtime = Timestamp {
            secs: 1_200_000_000,
            nanos: 0,
        };
        let attrs = SetAttrs {
            mtime: Some(mtime),
            ..SetAttrs::default()
        };
        let before = c.counters().await.unwrap();

        // A new file: its bytes, its mode and time, under its name, nothing else left.
        let data = pattern(300_000, 9);
        let reg = source(&c, &data).await;
        let (extents, hashes) = extents_of(a, 0, &data, &[262_144, 37_856]);
        let target = (S, "put.bin", 0o640, true);
        let write = Some((reg.desc(), extents.clone(), hashes.clone()));
        let attr = c.file_put(target, write, a, attrs).await.unwrap();
        assert_eq!(attr.size, data.len() as u64);
        assert_eq!(fs::read(env.share("put.bin")).unwrap(), data);
        let meta = fs::metadata(env.share("put.bin")).unwrap();
        assert_eq!(meta.mode() & 0o7777, 0o640);
        assert_eq!(meta.mtime(), 1_200_000_000);
        assert_eq!((meta.dev(), meta.ino()), (attr.dev, attr.ino));
        assert!(temp_files(&env.share("")).is_empty());
        let after = c.counters().await.unwrap();
        assert!(
            after.read_bytes >= before.read_bytes + data.len() as u64,
            "pulled one-sided"
        );

        // Exclusive and the name taken: Exists, the file there untouched.
        let write = Some((reg.desc(), extents.clone(), hashes.clone()));
        let other = (S, "put.bin", 0o600, true);
        let e = c.file_put(other, write, a, SetAttrs::default()).await;
        assert_eq!(kind(e), ErrorKind::Exists);
        assert_eq!(fs::read(env.share("put.bin")).unwrap(), data);
        assert!(temp_files(&env.share("")).is_empty());

        // Not exclusive: the file is replaced whole, atomically (a new inode).
        let small = pattern(10, 3);
        let reg2 = source(&c, &small).await;
        let (e2, h2) = extents_of(a, 0, &small, &[10]);
        let replace = (S, "put.bin", 0o600, false);
        let attr2 = c
            .file_put(replace, Some((reg2.desc(), e2, h2)), a, SetAttrs::default())
            .await
            .unwrap();
        assert_eq!(fs::read(env.share("put.bin")).unwrap(), small);
        assert_ne!(
            attr2.ino, attr.ino,
            "replaced by a new file, not rewritten in place"
        );

        // A wrong hash: no name, no staged file left.
        let mut bad = hashes.clone();
        bad[1][0] ^= 1;
        let target = (S, "bad.bin", 0o644, true);
        let e = c
            .file_put(target, Some((reg.desc(), extents, bad)), a, attrs)
            .await;
        assert_eq!(kind(e), ErrorKind::Integrity);
        assert!(!env.share("bad.bin").exists());
        assert!(temp_files(&env.share("")).is_empty());

        // No bytes: an empty file. A missing directory: NotFound, nothing made.
        let attr = c
            .file_put((S, "empty", 0o644, true), None, a, SetAttrs::default())
            .await
            .unwrap();
        assert_eq!(attr.size, 0);
        assert_eq!(fs::read(env.share("empty")).unwrap(), b"");
        let e = c
            .file_put(
                (S, "no/such/dir", 0o644, true),
                None,
                a,
                SetAttrs::default(),
            )
            .await;
        assert_eq!(kind(e), ErrorKind::NotFound);
        // Hostile paths are refused as for any write.
        let e = c
            .file_put((S, "../escape", 0o644, true), None, a, SetAttrs::default())
            .await;
        assert!(e.is_err(), "a path outside the share");
        assert!(temp_files(&env.share("")).is_empty());
    });
}
