//! Tests on a real RDMA device. They need one, so they are `#[ignore]`d on ordinary
//! machines; `scripts/test-rdma.sh` runs them with `--ignored` inside the Soft-RoCE VM,
//! with `FERRY_RDMA_ADDR` set to the device's address.

use std::net::SocketAddr;
use std::time::Duration;

use super::*;
use crate::transport::{Buffer, FileWindow};

fn addr() -> SocketAddr {
    let ip = std::env::var("FERRY_RDMA_ADDR").expect(
        "FERRY_RDMA_ADDR must name the RDMA device's IP address (see scripts/test-rdma.sh)",
    );
    SocketAddr::new(ip.parse().expect("FERRY_RDMA_ADDR is an IP address"), 0)
}

/// A connected pair: (client side, server side, the listener kept alive).
async fn pair() -> (Rdma, Rdma, Listener) {
    let listener = Listener::bind(addr()).expect("bind");
    let mut target = addr();
    target.set_port(listener.local_port());
    let (client, server) = tokio::join!(connect(target), async {
        listener.accept().await.expect("accept").establish().await
    });
    (
        client.expect("connect"),
        server.expect("establish"),
        listener,
    )
}

const T: Duration = Duration::from_secs(60);

async fn bounded<F: std::future::Future>(f: F) -> F::Output {
    tokio::time::timeout(T, f)
        .await
        .expect("test step timed out")
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device: scripts/test-rdma.sh"]
async fn control_messages_in_order_including_large_and_a_flood() {
    let (c, s, _l) = pair().await;
    assert_eq!(c.kind(), TransportKind::Rdma);
    // A flood the receiver does not read yet: far more frames than credits.
    for i in 0..2000u32 {
        c.send(i.to_le_bytes().to_vec()).await.unwrap();
    }
    let big = pattern(crate::codec::MAX_CTRL_FRAME_BYTES, 7);
    c.send(big.clone()).await.unwrap();
    c.send(Vec::new()).await.unwrap();
    for i in 0..2000u32 {
        let m = bounded(s.recv()).await.unwrap().unwrap();
        assert_eq!(m, i.to_le_bytes());
    }
    assert_eq!(bounded(s.recv()).await.unwrap().unwrap(), big);
    assert_eq!(bounded(s.recv()).await.unwrap().unwrap(), Vec::<u8>::new());
    // And back.
    s.send(b"pong".to_vec()).await.unwrap();
    assert_eq!(bounded(c.recv()).await.unwrap().unwrap(), b"pong");
    // Orderly close: the peer sees the end of the stream.
    c.close();
    assert_eq!(bounded(s.recv()).await.unwrap(), None);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device: scripts/test-rdma.sh"]
async fn read_and_write_move_bytes_one_sided() {
    let (c, s, _l) = pair().await;
    // The client exposes a file window read-only and a buffer writable, as rcp does.
    let mut f = tempfile::tempfile().unwrap();
    let data = pattern(3 << 20, 1);
    std::io::Write::write_all(&mut f, &data).unwrap();
    let window = FileWindow::map(&f, 0, data.len()).unwrap();
    let src = c
        .register(Memory::File(window), Access::RemoteRead)
        .unwrap();
    let sink_buf = Buffer::new(data.len()).unwrap();
    let sink = c
        .register(Memory::Buffer(sink_buf.clone()), Access::RemoteWrite)
        .unwrap();

    // The server pulls with READ into its own local buffer...
    let local = Buffer::new(data.len()).unwrap();
    let local_reg = s
        .register(Memory::Buffer(local.clone()), Access::Local)
        .unwrap();
    let whole = RemoteSlice::of(&src.desc(), 0, data.len() as u32).unwrap();
    bounded(s.read(whole, &local_reg, 0)).await.unwrap();
    assert!(local.read().await[..] == data[..]);
    // ...in pieces too, concurrently.
    let part = |i: u64| {
        let sl = RemoteSlice::of(&src.desc(), i << 20, 1 << 20).unwrap();
        s.read(sl, &local_reg, (i as usize) << 20)
    };
    let (a, b, c3) = bounded(async { tokio::join!(part(0), part(1), part(2)) }).await;
    a.unwrap();
    b.unwrap();
    c3.unwrap();
    // ...and pushes with WRITE into the client's buffer.
    let dst = RemoteSlice::of(&sink.desc(), 0, data.len() as u32).unwrap();
    bounded(s.write(&local_reg, 0, dst)).await.unwrap();
    assert!(sink_buf.read().await[..] == data[..]);
    assert_eq!(c.outstanding(), 0);
    assert_eq!(s.outstanding(), 0);
    drop((src, sink, local_reg));
    assert_eq!(c.registrations(), 0);
    assert_eq!(s.registrations(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device: scripts/test-rdma.sh"]
async fn a_revoked_or_out_of_bounds_rkey_fails_cleanly_and_the_listener_serves_on() {
    let listener = Listener::bind(addr()).unwrap();
    let mut target = addr();
    target.set_port(listener.local_port());
    for case in ["revoked", "out of bounds", "write to read-only"] {
        let (c, s) = tokio::join!(connect(target), async {
            listener.accept().await.unwrap().establish().await
        });
        let (c, s) = (c.unwrap(), s.unwrap());
        let buf = Buffer::new(4096).unwrap();
        let reg = c
            .register(Memory::Buffer(buf.clone()), Access::RemoteRead)
            .unwrap();
        let desc = reg.desc();
        let local = Buffer::new(8192).unwrap();
        let local_reg = s.register(Memory::Buffer(local), Access::Local).unwrap();
        let slice = RemoteSlice {
            rkey: desc.rkey,
            addr: desc.addr,
            len: 4096,
        };
        let result = match case {
            "revoked" => {
                drop(reg);
                bounded(s.read(slice, &local_reg, 0)).await
            }
            "out of bounds" => {
                let beyond = RemoteSlice { len: 8192, ..slice };
                bounded(s.read(beyond, &local_reg, 0)).await
            }
            _ => bounded(s.write(&local_reg, 0, slice)).await,
        };
        match result {
            Err(TransportError::RemoteAccess {
                fault: AccessFault::Refused,
                ..
            }) => {}
            other => panic!("{case}: expected a remote access error, got {other:?}"),
        }
        // The connection is over on both sides, cleanly.
        assert!(bounded(s.recv()).await.is_err(), "{case}");
        assert!(!matches!(bounded(c.recv()).await, Ok(Some(_))), "{case}");
    }
    // The listener still serves a healthy connection.
    let (c, s) = tokio::join!(connect(target), async {
        listener.accept().await.unwrap().establish().await
    });
    let (c, s) = (c.unwrap(), s.unwrap());
    c.send(b"still here".to_vec()).await.unwrap();
    assert_eq!(bounded(s.recv()).await.unwrap().unwrap(), b"still here");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device: scripts/test-rdma.sh"]
async fn a_dropped_peer_fails_outstanding_work() {
    let (c, s, _l) = pair().await;
    let buf = Buffer::new(1 << 20).unwrap();
    let reg = c.register(Memory::Buffer(buf), Access::RemoteRead).unwrap();
    drop(c);
    let local = Buffer::new(1 << 20).unwrap();
    let local_reg = s.register(Memory::Buffer(local), Access::Local).unwrap();
    let slice = RemoteSlice::of(&reg.desc(), 0, 1 << 20).unwrap();
    // Either refused outright (already closed) or failed on the device: never hangs.
    assert!(bounded(s.read(slice, &local_reg, 0)).await.is_err());
    assert!(bounded(s.recv()).await.is_err());
    drop(reg);
}

#[test]
fn no_device_is_reported_not_crashed() {
    // On a machine without RDMA this is the clear error; with a device it lists it.
    match available() {
        Ok(devices) => assert!(!devices.is_empty()),
        Err(e) => assert!(e.to_string().contains("RDMA is not available"), "{e}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device: scripts/test-rdma.sh"]
async fn messages_sent_just_before_close_and_drop_arrive_then_the_end() {
    // A server answering a wrong secret sends its error, closes and drops the
    // connection at once: the peer must get the answer and an orderly end, never a
    // bare disconnect (the send queue flushed before the device sent it).
    for round in 0..20u8 {
        let (c, s, _l) = pair().await;
        let last = pattern(300, round);
        s.send(last.clone()).await.unwrap();
        s.close();
        drop(s);
        let got = bounded(c.recv()).await;
        assert_eq!(
            got.as_ref().ok(),
            Some(&Some(last)),
            "round {round}: {got:?}"
        );
        let end = bounded(c.recv()).await;
        assert!(matches!(end, Ok(None)), "round {round}: {end:?}");
    }
}
