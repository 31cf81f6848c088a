//! A hand-written client speaks the protocol directly to a real ferryd process and
//! sends what rcp never would: NUL bytes and absolute paths, unknown transfers, bad
//! windows, revoked and out-of-bounds rkeys, garbage and malformed frames. Each gets a
//! typed error (at most that connection closes) and the server keeps serving.

use std::io::{Read, Write};
use std::sync::Arc;

use ferry_client::Client;
use ferry_common::chunk::hash_chunk;
use ferry_common::msg::{ErrorKind, RegionDesc, Request, Response};
use ferry_common::transport::{Access, Buffer, Memory};
use ferry_tests::Env;

use ferry_tests::runtime;

async fn connect(env: &Env) -> Client {
    let (host, port) = env.server().addr().rsplit_once(':').unwrap();
    ferry_tests::connect(host, port.parse().unwrap(), ferry_tests::test_choice())
        .await
        .unwrap()
}

fn kind(r: Result<Response, ferry_client::ClientError>) -> ErrorKind {
    match r {
        Err(e) => e
            .remote_kind()
            .unwrap_or_else(|| panic!("not a remote error: {e}")),
        Ok(ok) => panic!("expected an error, got {ok:?}"),
    }
}

fn stat(path: &str) -> Request {
    Request::Stat {
        share: "data".into(),
        path: path.into(),
        follow: true,
    }
}

/// The server still answers a plain request on a fresh connection.
async fn still_serving(env: &Env) {
    let c = connect(env).await;
    assert!(matches!(c.call(stat("")).await, Ok(Response::Attr(_))));
}

#[test]
fn hostile_paths_get_typed_errors() {
    let env = Env::new();
    runtime().block_on(async {
        let c = connect(&env).await;
        assert_eq!(kind(c.call(stat("a\0b")).await), ErrorKind::InvalidPath);
        assert_eq!(
            kind(c.call(stat("/etc/passwd")).await),
            ErrorKind::OutsideShare
        );
        assert_eq!(
            kind(c.call(stat("../../etc")).await),
            ErrorKind::OutsideShare
        );
        assert_eq!(
            kind(c.call(stat(&"n".repeat(300))).await),
            ErrorKind::InvalidPath
        );
        let mkdir = Request::Mkdir {
            share: "data".into(),
            path: "x\0y".into(),
            mode: 0o755,
            exist_ok: false,
        };
        assert_eq!(kind(c.call(mkdir).await), ErrorKind::InvalidPath);
        let reserved = Request::UploadOpen {
            share: "data".into(),
            path: ".ferry-tmp.0123456789abcdef".into(),
            size: 1,
            mode: 0o644,
            mtime: Default::default(),
        };
        assert_eq!(kind(c.call(reserved).await), ErrorKind::InvalidPath);
        // The share root itself is never a write target (chmod, replace...).
        let chmod_root = Request::SetAttr {
            share: "data".into(),
            path: "".into(),
            mode: Some(0),
            mtime: None,
        };
        assert_eq!(kind(c.call(chmod_root).await), ErrorKind::InvalidPath);
        // The same connection still works.
        assert!(matches!(c.call(stat("")).await, Ok(Response::Attr(_))));
    });
    assert_eq!(std::fs::read_dir(env.share("")).unwrap().count(), 0);
}

#[test]
fn bad_transfer_requests_are_refused() {
    let env = Env::new();
    runtime().block_on(async {
        let c = connect(&env).await;
        let region = RegionDesc {
            addr: 0x1000,
            len: 4096,
            rkey: 1,
        };
        let window = Request::UploadWindow {
            transfer: 999,
            offset: 0,
            region,
            hashes: vec![[0; 32]],
        };
        assert_eq!(kind(c.call(window).await), ErrorKind::Protocol);
        let transfer = open_upload(&c, "f", 10 << 20).await;
        // Unaligned window, and a hash count that does not match the window.
        let unaligned = Request::UploadWindow {
            transfer,
            offset: 17,
            region,
            hashes: vec![[0; 32]],
        };
        assert_eq!(kind(c.call(unaligned).await), ErrorKind::Protocol);
        let miscounted = Request::UploadWindow {
            transfer,
            offset: 0,
            region: RegionDesc {
                len: 2 << 20,
                ..region
            },
            hashes: vec![[0; 32]],
        };
        assert_eq!(kind(c.call(miscounted).await), ErrorKind::Protocol);
        // Committing before anything was pulled.
        let commit = Request::UploadCommit {
            transfer,
            manifest: [0; 32],
        };
        assert_eq!(kind(c.call(commit).await), ErrorKind::Integrity);
        assert!(matches!(
            c.call(Request::Close { transfer }).await,
            Ok(Response::Ok)
        ));
        // A download transfer used as an upload.
        let dl = Request::DownloadWindow {
            transfer,
            offset: 0,
            region,
        };
        assert_eq!(kind(c.call(dl).await), ErrorKind::Protocol);
    });
    // The aborted upload left nothing behind, not even its temporary file.
    assert_eq!(std::fs::read_dir(env.share("")).unwrap().count(), 0);
}

/// Opens an upload of `size` bytes to `name` and returns its transfer id.
async fn open_upload(c: &Client, name: &str, size: u64) -> u64 {
    let open = Request::UploadOpen {
        share: "data".into(),
        path: name.into(),
        size,
        mode: 0o644,
        mtime: Default::default(),
    };
    let Ok(Response::UploadOpened { transfer }) = c.call(open).await else {
        panic!("upload did not open");
    };
    transfer
}

/// Opens an upload of one 4 KiB chunk and offers `region` for it.
/// Offers a bad region for the server to pull and checks that the pull fails. On the
/// TCP transport the engine refuses the access and the connection lives on (the
/// server answers `Io`); on RDMA a remote access error moves both queue pairs to the
/// error state, so the call fails with the connection, and the next case reconnects.
async fn bad_offer_fails(
    env: &Env,
    c: &mut Client,
    name: &str,
    region: RegionDesc,
    hash: [u8; 32],
) {
    let transfer = open_upload(c, name, 4096).await;
    let window = Request::UploadWindow {
        transfer,
        offset: 0,
        region,
        hashes: vec![hash],
    };
    let result = c.call(window).await;
    if ferry_tests::test_transport() == "tcp" {
        assert_eq!(kind(result), ErrorKind::Io);
    } else {
        assert!(result.is_err(), "{name}: the bad pull succeeded");
        *c = connect(env).await;
    }
}

#[test]
fn reads_of_revoked_or_out_of_bounds_regions_fail_cleanly() {
    let env = Env::new();
    runtime().block_on(async {
        let mut c = connect(&env).await;
        let buf = Buffer::new(4096).unwrap();
        buf.write().await.fill(7);
        let hash = hash_chunk(&buf.read().await);

        // A region revoked before the server pulls it.
        let reg = c
            .transport()
            .register(Memory::Buffer(buf.clone()), Access::RemoteRead)
            .unwrap();
        let revoked = reg.desc();
        drop(reg);
        bad_offer_fails(&env, &mut c, "a", revoked, hash).await;

        // A region that claims more than was registered: the server's READ of the
        // window reaches past the registration and is refused by this side.
        let small = Buffer::new(1024).unwrap();
        let reg = c
            .transport()
            .register(Memory::Buffer(small), Access::RemoteRead)
            .unwrap();
        let lying = RegionDesc {
            len: 4096,
            ..reg.desc()
        };
        bad_offer_fails(&env, &mut c, "b", lying, hash).await;

        // Local-only memory is never readable by the peer.
        let reg = c
            .transport()
            .register(Memory::Buffer(buf.clone()), Access::Local)
            .unwrap();
        bad_offer_fails(&env, &mut c, "c", reg.desc(), hash).await;

        // The connection (TCP) or the server (RDMA) still works: a correct offer
        // succeeds.
        let reg = c
            .transport()
            .register(Memory::Buffer(buf.clone()), Access::RemoteRead)
            .unwrap();
        let transfer = open_upload(&c, "ok", 4096).await;
        let window = Request::UploadWindow {
            transfer,
            offset: 0,
            region: reg.desc(),
            hashes: vec![hash],
        };
        assert!(matches!(
            c.call(window).await,
            Ok(Response::WindowPulled {
                bytes: 4096,
                reused: 0
            })
        ));
        let manifest = ferry_common::chunk::manifest_id(4096, 1 << 20, &[hash]);
        assert!(matches!(
            c.call(Request::UploadCommit { transfer, manifest }).await,
            Ok(Response::Committed { size: 4096 })
        ));
    });
    assert_eq!(std::fs::read(env.share("ok")).unwrap(), vec![7u8; 4096]);
}

#[test]
fn garbage_and_malformed_frames_close_only_that_connection() {
    let env = Env::new();
    let addr = env.server().addr().to_string();
    // Not Ferry at all.
    let mut s = std::net::TcpStream::connect(&addr).unwrap();
    s.write_all(b"GET / HTTP/1.0\r\n\r\n").unwrap();
    let mut sink = Vec::new();
    s.set_read_timeout(Some(std::time::Duration::from_secs(10)))
        .unwrap();
    let _ = s.read_to_end(&mut sink);

    // The right greeting, then a control frame claiming 4 GiB.
    let mut s = std::net::TcpStream::connect(&addr).unwrap();
    s.write_all(b"FRYTCP\x00\x01").unwrap();
    s.write_all(&[0x01, 0xff, 0xff, 0xff, 0xff]).unwrap();
    s.set_read_timeout(Some(std::time::Duration::from_secs(10)))
        .unwrap();
    let _ = s.read_to_end(&mut sink);

    // The right greeting, then a well-framed message that does not decode.
    let mut s = std::net::TcpStream::connect(&addr).unwrap();
    s.write_all(b"FRYTCP\x00\x01").unwrap();
    s.write_all(&[0x01, 3, 0, 0, 0, 0xee, 0xee, 0xee]).unwrap();
    s.set_read_timeout(Some(std::time::Duration::from_secs(10)))
        .unwrap();
    let _ = s.read_to_end(&mut sink);

    runtime().block_on(still_serving(&env));
    env.server().assert_running();
    let log = env.server().stderr();
    assert!(log.contains("malformed control message"), "{log}");
}

#[test]
fn requests_before_the_handshake_close_the_session() {
    let env = Env::new();
    runtime().block_on(async {
        let (host, port) = env.server().addr().rsplit_once(':').unwrap();
        let t = ferry_common::transport::tcp::Tcp::connect((host, port.parse::<u16>().unwrap()))
            .await
            .unwrap();
        let t: Arc<dyn ferry_common::transport::Transport> = Arc::new(t);
        let req = ferry_common::msg::Message::Request {
            id: 1,
            body: stat(""),
        };
        t.send(ferry_common::codec::encode(&req).unwrap())
            .await
            .unwrap();
        // The server answers nothing and closes.
        let got = tokio::time::timeout(std::time::Duration::from_secs(10), t.recv())
            .await
            .expect("server did not close the session");
        assert!(matches!(got, Ok(None) | Err(_)), "{got:?}");
        still_serving(&env).await;
    });
}
