//! Mapped files against a real ferryd: `MapOpen` registers a file read-only with its
//! chunk manifest, the client reads data and manifest with one-sided READs (no request
//! per read), verifies every chunk, and `MapRelease` (or the end of the connection)
//! revokes the registrations. Also: versions, refusals, the mapped-byte budget,
//! `StatFs`, `Stats`, and a file truncated under its mapping (the SIGBUS check: the
//! READ fails, ferryd lives on).
//!
//! Under the RDMA suite a refused READ moves the queue pairs to the error state and
//! ends that connection, so tests that go on after one reconnect.

use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use ferry_client::{Client, ClientError};
use ferry_common::chunk::{chunk_count, chunk_len, hash_chunk, manifest_id};
use ferry_common::msg::{ErrorKind, FileKind, Hash256, MappedFile, MAP_WINDOW_BYTES};
use ferry_common::transport::{
    Access, AccessFault, Buffer, Memory, Registration, RemoteSlice, TransportChoice, TransportError,
};
use ferry_server::{Config, Server, ShareConfig};
use ferry_tests::{write_random_file, Env, DEFAULT_SHARE as SHARE};

use ferry_tests::runtime;

async fn connect_to(addr: &str, choice: TransportChoice) -> Client {
    let (host, port) = addr.rsplit_once(':').unwrap();
    ferry_tests::connect_to(host, port.parse().unwrap(), choice)
        .await
        .unwrap()
}

async fn connect(env: &Env) -> Client {
    connect_to(env.server().addr(), ferry_tests::test_choice()).await
}

fn remote_kind<T: std::fmt::Debug>(r: Result<T, ClientError>) -> ErrorKind {
    match r {
        Err(e) => e
            .remote_kind()
            .unwrap_or_else(|| panic!("not a remote error: {e}")),
        Ok(ok) => panic!("expected an error, got {ok:?}"),
    }
}

/// A local buffer of `len` bytes registered for READs to land in.
fn local_buffer(c: &Client, len: usize) -> Registration {
    c.transport()
        .register(Memory::Buffer(Buffer::new(len).unwrap()), Access::Local)
        .unwrap()
}

/// The slice of the mapped file's regions holding chunk `index`. A chunk never spans
/// two regions: the window size is a multiple of every chunk size.
fn chunk_slice(m: &MappedFile, index: u64) -> RemoteSlice {
    let chunk = u64::from(m.version.chunk_bytes);
    assert_eq!(m.window_bytes % chunk, 0);
    let offset = index * chunk;
    let len = chunk_len(m.version.size, m.version.chunk_bytes, index);
    let region = &m.regions[(offset / m.window_bytes) as usize];
    RemoteSlice::of(region, offset % m.window_bytes, len as u32).expect("chunk inside its region")
}

/// Reads the manifest region: the chunk hashes, checked against `version.manifest`.
async fn read_manifest(c: &Client, m: &MappedFile) -> Vec<Hash256> {
    let chunks = chunk_count(m.version.size, m.version.chunk_bytes) as usize;
    let desc = m.manifest.expect("a non-empty file has a manifest region");
    assert_eq!(desc.len, chunks as u64 * 32);
    let dst = local_buffer(c, chunks * 32);
    c.transport()
        .read(RemoteSlice::of(&desc, 0, desc.len as u32).unwrap(), &dst, 0)
        .await
        .unwrap();
    let bytes = dst.buffer().unwrap().read().await;
    let hashes: Vec<Hash256> = bytes
        .chunks_exact(32)
        .map(|h| h.try_into().unwrap())
        .collect();
    assert_eq!(
        manifest_id(
            m.version.algorithm,
            m.version.size,
            m.version.chunk_bytes,
            &hashes
        ),
        m.version.manifest,
        "the manifest region does not hash to the version's manifest id"
    );
    hashes
}

/// Reads every chunk with one-sided READs, verifies each against `hashes`, and
/// returns the file's bytes.
async fn read_all(c: &Client, m: &MappedFile, hashes: &[Hash256]) -> Vec<u8> {
    let chunk = m.version.chunk_bytes as usize;
    let dst = local_buffer(c, chunk);
    let mut data = Vec::with_capacity(m.version.size as usize);
    for (index, want) in hashes.iter().enumerate() {
        let slice = chunk_slice(m, index as u64);
        c.transport().read(slice, &dst, 0).await.unwrap();
        let bytes = dst.buffer().unwrap().read().await;
        let got = &bytes[..slice.len as usize];
        assert_eq!(
            &hash_chunk(m.version.algorithm, got),
            want,
            "chunk {index} fails its hash"
        );
        data.extend_from_slice(got);
    }
    data
}

fn same_bytes(path: &Path, data: &[u8]) {
    let disk = std::fs::read(path).unwrap();
    assert_eq!(disk.len(), data.len());
    assert!(disk == data, "mapped bytes differ from {}", path.display());
}

/// Polls until the server reports no mapped file (teardown is asynchronous).
async fn wait_unmapped(c: &Client) {
    for _ in 0..200 {
        let s = c.server_stats().await.unwrap();
        if s.mapped_files == 0 && s.mapped_bytes == 0 {
            return;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    panic!("mapped files still open: {:?}", c.server_stats().await);
}

#[test]
fn a_mapped_file_reads_and_verifies_without_requests() {
    let env = Env::new();
    let size = 5 * 1024 * 1024 + 123;
    write_random_file(&env.share("f"), size, 11);
    runtime().block_on(async {
        let mut c = connect(&env).await;
        let m = c.map_open(SHARE, "f", 64 << 10).await.unwrap();
        assert_eq!(m.version.chunk_bytes, 64 << 10);
        assert_eq!(m.version.size, size);
        assert_eq!(m.attr.size, size);
        assert_eq!(m.attr.kind, FileKind::File);
        assert_eq!(m.version.ino, m.attr.ino);
        assert_eq!(m.version.mtime, m.attr.mtime);
        assert_eq!(m.window_bytes, MAP_WINDOW_BYTES);
        assert_eq!(m.regions.len(), 1);
        assert_eq!(m.regions[0].len, size);

        let before = c.server_stats().await.unwrap();
        assert_eq!((before.mapped_files, before.mapped_bytes), (1, size));
        assert_eq!(before.connections, 1);
        let hashes = read_manifest(&c, &m).await;
        assert_eq!(hashes.len(), chunk_count(size, 64 << 10) as usize);
        let data = read_all(&c, &m, &hashes).await;
        let after = c.server_stats().await.unwrap();
        // The whole file and its manifest moved with no request but this Stats.
        assert_eq!(after.requests, before.requests + 1);
        same_bytes(&env.share("f"), &data);

        c.map_release(m.handle).await.unwrap();
        assert_eq!(
            remote_kind(c.map_release(m.handle).await),
            ErrorKind::Protocol
        );
        let stats = c.server_stats().await.unwrap();
        assert_eq!((stats.mapped_files, stats.mapped_bytes), (0, 0));

        // The released rkey is revoked.
        let dst = local_buffer(&c, 4096);
        let stale = RemoteSlice::of(&m.regions[0], 0, 4096).unwrap();
        match c.transport().read(stale, &dst, 0).await {
            Err(TransportError::RemoteAccess { fault, .. }) => {
                if ferry_tests::test_transport() == "tcp" {
                    assert_eq!(fault, AccessFault::InvalidRkey);
                } else {
                    c = connect(&env).await;
                }
            }
            other => panic!("READ of a released region: {other:?}"),
        }
        let manifest = m.manifest.unwrap();
        let stale = RemoteSlice::of(&manifest, 0, 32).unwrap();
        let dst = local_buffer(&c, 32);
        assert!(matches!(
            c.transport().read(stale, &dst, 0).await,
            Err(TransportError::RemoteAccess { .. })
        ));
    });
}

#[test]
fn files_larger_than_a_window_get_several_regions() {
    let env = Env::new();
    // Sparse: the server hashes and serves holes like any other bytes.
    let size = MAP_WINDOW_BYTES + (3 << 20) + 17;
    let f = std::fs::File::create(env.share("big")).unwrap();
    f.set_len(size).unwrap();
    for (at, seed) in [(0, 1u8), (MAP_WINDOW_BYTES - 5000, 2), (size - 300, 3)] {
        let bytes: Vec<u8> = (0..300u32).map(|i| (i as u8).wrapping_mul(seed)).collect();
        f.write_all_at(&bytes, at).unwrap();
    }
    drop(f);
    runtime().block_on(async {
        let c = connect(&env).await;
        let m = c.map_open(SHARE, "big", 1 << 20).await.unwrap();
        assert_eq!(m.regions.len(), 2);
        assert_eq!(m.regions[0].len, MAP_WINDOW_BYTES);
        assert_eq!(m.regions[1].len, size - MAP_WINDOW_BYTES);
        let hashes = read_manifest(&c, &m).await;
        let data = read_all(&c, &m, &hashes).await;
        same_bytes(&env.share("big"), &data);
        let stats = c.server_stats().await.unwrap();
        assert_eq!(stats.mapped_bytes, size);
    });
}

#[test]
fn versions_follow_the_content() {
    let env = Env::new();
    write_random_file(&env.share("v"), 300_000, 5);
    std::fs::File::create(env.share("empty")).unwrap();
    runtime().block_on(async {
        let c = connect(&env).await;
        let first = c.map_open(SHARE, "v", 4096).await.unwrap();
        let second = c.map_open(SHARE, "v", 4096).await.unwrap();
        assert_ne!(first.handle, second.handle);
        assert_eq!(first.version, second.version);
        let stats = c.server_stats().await.unwrap();
        assert_eq!((stats.mapped_files, stats.mapped_bytes), (2, 600_000));
        // Another chunk size is another manifest of the same file.
        let coarse = c.map_open(SHARE, "v", 100_000).await.unwrap();
        assert_eq!(coarse.version.chunk_bytes, 128 << 10);
        assert_ne!(coarse.version.manifest, first.version.manifest);
        for h in [first.handle, second.handle, coarse.handle] {
            c.map_release(h).await.unwrap();
        }

        // Changed in place, same size.
        let f = std::fs::OpenOptions::new()
            .write(true)
            .open(env.share("v"))
            .unwrap();
        f.write_all_at(b"changed", 1000).unwrap();
        drop(f);
        let third = c.map_open(SHARE, "v", 4096).await.unwrap();
        assert_eq!(third.version.size, first.version.size);
        assert_eq!(third.version.ino, first.version.ino);
        assert_ne!(third.version.manifest, first.version.manifest);
        assert_ne!(third.version, first.version);
        let hashes = read_manifest(&c, &third).await;
        let data = read_all(&c, &third, &hashes).await;
        same_bytes(&env.share("v"), &data);

        // An empty file: no regions, no manifest region.
        let empty = c.map_open(SHARE, "empty", 4096).await.unwrap();
        assert!(empty.regions.is_empty());
        assert!(empty.manifest.is_none());
        assert_eq!(empty.version.size, 0);
        assert_eq!(
            empty.version.manifest,
            manifest_id(empty.version.algorithm, 0, 4096, &[])
        );
        c.map_release(empty.handle).await.unwrap();
    });
}

#[test]
fn map_open_refuses_what_it_must() {
    let env = Env::new();
    std::fs::create_dir(env.share("dir")).unwrap();
    std::fs::write(env.root().join("outside"), b"secret").unwrap();
    std::os::unix::fs::symlink("../../outside", env.share("escape")).unwrap();
    std::os::unix::fs::symlink("dir", env.share("to-dir")).unwrap();
    let _socket = std::os::unix::net::UnixListener::bind(env.share("sock")).unwrap();
    runtime().block_on(async {
        let c = connect(&env).await;
        let open = |path: &'static str| {
            let c = c.clone();
            async move { remote_kind(c.map_open(SHARE, path, 4096).await) }
        };
        assert_eq!(open("dir").await, ErrorKind::IsADirectory);
        assert_eq!(open("to-dir").await, ErrorKind::IsADirectory);
        assert_eq!(open("").await, ErrorKind::IsADirectory);
        assert_eq!(open("../x").await, ErrorKind::OutsideShare);
        assert_eq!(open("escape").await, ErrorKind::OutsideShare);
        assert_eq!(open("missing").await, ErrorKind::NotFound);
        assert_eq!(open("sock").await, ErrorKind::InvalidPath);
        assert_eq!(
            remote_kind(c.map_open("nope", "x", 4096).await),
            ErrorKind::NoSuchShare
        );
        assert_eq!(remote_kind(c.map_release(77).await), ErrorKind::Protocol);
        let stats = c.server_stats().await.unwrap();
        assert_eq!((stats.mapped_files, stats.mapped_bytes), (0, 0));
    });
}

#[test]
fn a_file_truncated_while_mapped_fails_the_read_not_the_server() {
    let env = Env::new();
    write_random_file(&env.share("t"), 1 << 20, 9);
    runtime().block_on(async {
        let mut c = connect(&env).await;
        let mut reconnected = false;
        let m = c.map_open(SHARE, "t", 64 << 10).await.unwrap();
        std::fs::OpenOptions::new()
            .write(true)
            .open(env.share("t"))
            .unwrap()
            .set_len(4096)
            .unwrap();
        // The last chunk's pages are gone from the file: touching them through the
        // mapping would SIGBUS the server.
        let dst = local_buffer(&c, 64 << 10);
        let last = chunk_slice(&m, 15);
        let result = c.transport().read(last, &dst, 0).await;
        if ferry_tests::test_transport() == "tcp" {
            match result {
                Err(TransportError::RemoteAccess { fault, .. }) => {
                    assert_eq!(fault, AccessFault::Refused)
                }
                other => panic!("READ past the truncated end: {other:?}"),
            }
        } else if result.is_err() {
            // RDMA serves pinned pages (a snapshot or zeros) or refuses; either way
            // the server lives. A refusal ended the connection, and its mapped files
            // with it.
            c = connect(&env).await;
            reconnected = true;
        }
        env.server().assert_running();
        let attr = c.stat(SHARE, "t", true).await.unwrap();
        assert_eq!(attr.size, 4096);
        // The still-backed start of the file reads on the same connection (TCP).
        let first = chunk_slice(&m, 0);
        let first = RemoteSlice { len: 4096, ..first };
        if ferry_tests::test_transport() == "tcp" {
            c.transport().read(first, &dst, 0).await.unwrap();
        }
        if !reconnected {
            c.map_release(m.handle).await.unwrap();
        }
    });
    env.server().assert_running();
}

/// An in-process ferryd on TCP with a small mapped-byte budget.
async fn budget_server(root: &Path, max_mapped_bytes: u64) -> (Arc<Server>, String) {
    let mut config = Config::with_shares(
        "127.0.0.1:0".parse().unwrap(),
        vec![ShareConfig {
            name: SHARE.into(),
            path: root.to_owned(),
            read_only: true,
            secret_file: Some(ferry_tests::write_secret_file(root)),
            secret_env: None,
            hash: None,
            encryption: None,
            owners: Default::default(),
            root_squash: true,
            allow_devices: false,
            allow_setid: false,
        }],
    );
    config.max_mapped_bytes = max_mapped_bytes;
    let server = Server::new(&config).unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    tokio::spawn(server.clone().serve_tcp(listener));
    (server, addr)
}

#[test]
fn the_mapped_byte_budget_is_shared_and_returned() {
    let dir = tempfile::tempdir().unwrap();
    for name in ["a", "b"] {
        write_random_file(&dir.path().join(name), 600_000, 3);
    }
    runtime().block_on(async {
        let (server, addr) = budget_server(dir.path(), 1_000_000).await;
        let one = connect_to(&addr, TransportChoice::Tcp).await;
        let two = connect_to(&addr, TransportChoice::Tcp).await;
        let a = one.map_open(SHARE, "a", 4096).await.unwrap();
        // Over the server-wide budget, from another connection: busy.
        assert_eq!(
            remote_kind(two.map_open(SHARE, "b", 4096).await),
            ErrorKind::Busy
        );
        let stats = two.server_stats().await.unwrap();
        assert_eq!(stats.connections, 2);
        assert_eq!((stats.mapped_files, stats.mapped_bytes), (1, 600_000));
        // Releasing returns the bytes to the budget.
        one.map_release(a.handle).await.unwrap();
        let b = two.map_open(SHARE, "b", 4096).await.unwrap();
        assert_eq!(b.version.size, 600_000);
        // The end of a connection releases its mapped files.
        two.close();
        drop(two);
        wait_unmapped(&one).await;
        assert_eq!(server.stats().mapped_files, 0);
        assert!(one.map_open(SHARE, "a", 4096).await.is_ok());
    });
}

#[test]
fn statfs_describes_the_share() {
    let env = Env::new();
    runtime().block_on(async {
        let c = connect(&env).await;
        let s = c.statfs(SHARE).await.unwrap();
        assert!(s.block_size > 0);
        assert!(s.blocks > 0);
        assert!(s.blocks_avail <= s.blocks_free && s.blocks_free <= s.blocks);
        assert!(s.name_max > 0);
        assert_eq!(remote_kind(c.statfs("nope").await), ErrorKind::NoSuchShare);
    });
}
