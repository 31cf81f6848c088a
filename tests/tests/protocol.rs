//! The client library offers a real ferryd regions it must not be able to pull: revoked,
//! smaller than claimed, or not remotely readable. Each pull fails cleanly and ferryd
//! keeps serving. Runs on both transports; the hostile inputs that need a hand-written
//! client of the TCP transport are in `hostile.rs`.

use ferry_client::Client;
use ferry_common::chunk::hash_chunk;
use ferry_common::msg::{ErrorKind, RegionDesc, Request, Response};
use ferry_common::transport::{Access, Buffer, Memory};
use ferry_tests::Env;

use ferry_tests::runtime;

async fn connect(env: &Env) -> Client {
    ferry_tests::connect(env.server(), ferry_tests::test_choice())
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

/// Opens an upload of `size` bytes to `name` and returns its transfer id.
async fn open_upload(c: &Client, name: &str, size: u64) -> u64 {
    let open = Request::UploadOpen {
        share: "data".into(),
        path: name.into(),
        size,
        mode: 0o644,
        mtime: Default::default(),
    };
    let Ok(Response::UploadOpened { transfer, .. }) = c.call(open).await else {
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
        let hash = hash_chunk(ferry_common::msg::HashAlgorithm::Blake3, &buf.read().await);

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
        let manifest = ferry_common::chunk::manifest_id(
            ferry_common::msg::HashAlgorithm::Blake3,
            4096,
            1 << 20,
            &[hash],
        );
        assert!(matches!(
            c.call(Request::UploadCommit { transfer, manifest }).await,
            Ok(Response::Committed { size: 4096 })
        ));
    });
    assert_eq!(std::fs::read(env.share("ok")).unwrap(), vec![7u8; 4096]);
}
